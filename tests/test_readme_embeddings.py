"""The README's embeddings request gives the answer it shows (issue 39): the page is sent as the
README's pipeline sends it to the app serving models/embed, and the usage and cosines it prints
must be the comment line under it (cosines within 0.01: float kernels differ a little between CPUs)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.test_readme_requests import man_page

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^man_page (\S+) \| python3 -c .*?\"input\": \[sys\.stdin\.read\(\), (.*?)\]\}\)\)'.*?\n"
                   r".*?/v1/embeddings.*?\n.*?\n# (\{.*?\}) (\[.*?\])$", re.M | re.S)


def test_the_readme_embeddings_request_gives_the_answer_it_shows():
    from fastapi.testclient import TestClient

    from longdoc.service.app import create_app
    from longdoc.service.settings import Settings

    m = BLOCK.search((ROOT / "README.md").read_text())
    assert m, "the README's embeddings request"
    page, texts, usage, cosines = m.group(1), ast.literal_eval(f"[{m.group(2)}]"), ast.literal_eval(m.group(3)), \
        ast.literal_eval(m.group(4))
    document = man_page(page)
    with TestClient(create_app(Settings(models={"embed": ROOT / "models" / "embed"}, warmup=False))) as client:
        r = client.post("/v1/embeddings", json={"input": [document, *texts]})
    assert r.status_code == 200, r.text
    p, *q = [d["embedding"] for d in r.json()["data"]]
    assert r.json()["usage"] == usage
    assert [round(sum(a * b for a, b in zip(p, v)), 3) for v in q] == pytest.approx(cosines, abs=0.01)
