"""The README's requests give the answers the README shows: each `man_page PAGE | ask TASK 'JSON'`
line of its "Requests" block is sent, as the README's shell functions send it, to the app serving
the shipped default models, and the answer must be the JSON in the comment lines under it (strings
and integers exactly; scores within 1%, since int8 kernels differ a little between CPUs). A change
to the models or to answer shaping that changes these answers must update the README."""

from __future__ import annotations

import gzip
import json
import math
import re
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
REQUEST = re.compile(r"^man_page (\S+) \| ask (\w+) '(.*)'$")


def readme_requests() -> list[tuple[str, str, dict, dict]]:
    """(page, task, body without the document, the answer shown) of each request in the README."""
    block = re.search(r"^## Requests\n.*?```bash\n(.*?)```", README, re.S | re.M).group(1)
    found, lines = [], block.splitlines()
    for i, line in enumerate(lines):
        if m := REQUEST.match(line):
            shown = []
            for answer in lines[i + 1:]:
                if not answer.startswith("# "):
                    break
                shown.append(answer[2:].strip())
            found.append((m.group(1), m.group(2), json.loads(m.group(3)), json.loads("".join(shown))))
    return found


def man_page(page: str) -> str:
    """The README's `man_page`: zcat | groff -t -man -Tutf8 -P-cbou -rLL=10000n."""
    path = Path("/usr/share/man") / page
    if shutil.which("groff") is None or not path.is_file():
        missing = f"needs groff and {path} (Debian: apt-get install groff manpages manpages-dev)"
        if os.environ.get("CI"):  # .ci/run installs them: under CI a missing tool fails, as elsewhere
            pytest.fail(missing)
        pytest.skip(missing)
    run = subprocess.run(["groff", "-t", "-man", "-Tutf8", "-P-cbou", "-rLL=10000n"],
                         input=gzip.decompress(path.read_bytes()), capture_output=True, timeout=60, check=True)
    return run.stdout.decode()


def same(answer, shown, where="") -> None:
    if isinstance(shown, float):
        assert isinstance(answer, float) and math.isclose(answer, shown, rel_tol=0.01), (where, answer, shown)
    elif isinstance(shown, dict):
        assert isinstance(answer, dict) and answer.keys() == shown.keys(), (where, answer, shown)
        for k in shown:
            same(answer[k], shown[k], f"{where}.{k}")
    elif isinstance(shown, list):
        assert isinstance(answer, list) and len(answer) == len(shown), (where, answer, shown)
        for i, (a, s) in enumerate(zip(answer, shown)):
            same(a, s, f"{where}[{i}]")
    else:
        assert answer == shown, (where, answer, shown)


def test_the_readme_shows_a_request_of_each_task():
    assert {task for _, task, _, _ in readme_requests()} >= {"classify", "qa", "summarize"}


def test_the_readme_requests_give_the_answers_it_shows():
    from longdoc.service.app import create_app
    from longdoc.service.settings import Settings

    requests = [(page, task, body, shown, man_page(page)) for page, task, body, shown in readme_requests()]
    settings = Settings(models={m: ROOT / "models" / m for m in ("qa", "summarize", "classify")},
                        warmup=False)
    with TestClient(create_app(settings)) as client:
        for page, task, body, shown, document in requests:
            r = client.post(f"/v1/{task}", json={**body, "document": document})
            assert r.status_code == 200, r.text
            same(r.json(), shown, f"{task} {page}")
