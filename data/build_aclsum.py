"""Build the out-of-domain summarization test set (issue 27): 250 long scientific papers with their
abstracts, from ACLSum (Takeshita et al., 2024; CC BY 4.0), which the `aclsum` package ships
(`.venv/bin/pip install -e '.[models]'`; nothing is downloaded).

    .venv/bin/python -m data.build_aclsum          # writes data/cache/aclsum/summarize_test.jsonl

One record a paper, in `longdoc eval`'s summarize format: {"id", "document", "summary", "title"}.
- summary: the paper's abstract (S2ORC's parse; white space collapsed).
- document: the paper's body without its abstract and title, laid out as a rendered man page is
  (a section heading at column 0, each paragraph one line indented 7 spaces), so that the lead
  baselines read the same way they read a man page: "lead" is the body's first sentence.
  A paper has no DESCRIPTION section, so "lead-description" is "lead" here.
All 250 papers of ACLSum's train, val and test parts are used: nothing here is trained on them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "cache" / "aclsum"
SPLITS = ("train", "val", "test")


def dataset_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("aclsum")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pip install aclsum (ACLSum's papers ship inside it)")
    return Path(list(spec.submodule_search_locations)[0]) / "dataset"


def paper_record(paper: dict) -> dict | None:
    """The summarize record of one S2ORC paper parse, or None without an abstract or a body."""
    parse = paper["pdf_parse"]
    abstract = " ".join(" ".join(p["text"] for p in parse["abstract"]).split())
    lines, section = [], None
    for paragraph in parse["body_text"]:
        heading = " ".join(" ".join(filter(None, (paragraph.get("sec_num"), paragraph["section"]))).split())
        if heading != section:
            lines += ["", heading.upper() or "BODY"]
            section = heading
        text = " ".join(paragraph["text"].split())
        if text:
            lines.append("       " + text)
    document = "\n".join(lines).strip("\n") + "\n"
    if not abstract or len(document) < 200:
        return None
    return {"id": paper["paper_id"], "document": document, "summary": abstract, "title": paper["title"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=OUT, help="output folder (default: data/cache/aclsum)")
    args = parser.parse_args(argv)
    data = dataset_dir()
    ids = [json.loads(line)["id"] for split in SPLITS for line in (data / f"{split}.jsonl").read_text().splitlines() if line.strip()]
    records, skipped = [], []
    for paper_id in ids:
        record = paper_record(json.loads((data / "paper_jsons" / f"{paper_id}.json").read_text()))
        if record is None:
            skipped.append(paper_id)
        else:  # the ACL Anthology id (the parse's own paper_id is a running number)
            records.append({**record, "id": paper_id})
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "summarize_test.jsonl").open("w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    print(f"{len(records)} papers -> {args.out / 'summarize_test.jsonl'}; skipped (no abstract or body): {skipped}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
