"""The shipped default models load through the serving runtime and answer on a held-out page."""

from pathlib import Path

import numpy as np

from longdoc.export import evaluate as E

MODELS = Path(__file__).resolve().parents[2] / "models"

# An excerpt of personality(2) from Debian's manpages 6.03-2 (a test-split page, never trained
# on), as data/build_manpages.py renders it. License: see models/qa/TRAINING-DATA-COPYRIGHT.
PERSONALITY_FLAGS = "DESCRIPTION\n" + "       ADDR_COMPAT_LAYOUT (since Linux 2.6.9)\n              With this flag set, provide legacy virtual address space layout.\n\n       ADDR_NO_RANDOMIZE (since Linux 2.6.12)\n              With this flag set, disable address-space-layout randomization.\n\n       ADDR_LIMIT_32BIT (since Linux 2.2)\n              Limit the address space to 32 bits.\n\n       ADDR_LIMIT_3GB (since Linux 2.4.0)\n              With this flag set, use 0xc0000000 as the offset at which to search a virtual memory chunk on mmap(2); otherwise use 0xffffe000.\n\n       FDPIC_FUNCPTRS (since Linux 2.6.11)\n              User-space function pointers to signal handlers point (on certain architectures) to descriptors.\n\n       MMAP_PAGE_ZERO (since Linux 2.4.0)\n              Map page 0 as read-only (to support binaries that depend on this SVr4 behavior).\n\n       READ_IMPLIES_EXEC (since Linux 2.6.8)\n              With this flag set, PROT_READ implies PROT_EXEC for mmap(2).\n\n"


def test_default_qa_model_is_long_sparse_small_and_answers():
    from longdoc.export.runtime import OnnxModel

    model = OnnxModel(MODELS / "qa", threads=1)
    m = model.manifest
    assert (m.task, m.dtype, m.max_length, m.attention["pattern"]) == ("qa", "int8", 4096, "bigbird")
    assert sum(f.stat().st_size for f in (MODELS / "qa").iterdir()) < 64 * 2**20
    for name in ("LICENSE", "MODEL_CARD.md", "tokenizer.json", "TRAINING-DATA-COPYRIGHT"):
        assert (MODELS / "qa" / name).is_file()
    lines = PERSONALITY_FLAGS.splitlines()
    gold = {lines[i].split()[0]: lines[i + 1].strip() for i in range(1, len(lines) - 1)
            if lines[i].startswith("       ") and not lines[i].startswith("        ")}
    assert len(gold) == 7
    answers = {}
    for term in gold:
        spans, _ = E.qa_spans(model, f"What does {term} do?", PERSONALITY_FLAGS, 4096, 64)
        answers[term] = PERSONALITY_FLAGS[spans[0].start : spans[0].end]
    # a small model (docs/models.md): it answers from the descriptions (never a tag line),
    # depends on the question, and gets 4 of these 7 exactly right as shipped (the other 3 are
    # parts of description sentences)
    assert all(any(a in g for g in gold.values()) for a in answers.values())
    assert len(set(answers.values())) >= 5
    assert sum(answers[t] == gold[t] for t in gold) >= 4


def test_default_classifier_is_long_sparse_small_and_tells_sections_2_and_3_apart():
    import json

    from longdoc.export.runtime import OnnxModel

    model = OnnxModel(MODELS / "classify", threads=1)
    m = model.manifest
    assert (m.task, m.dtype, m.max_length, m.attention["pattern"]) == ("classify", "int8", 4096, "bigbird")
    assert list(m.labels) == [str(s) for s in range(1, 9)]  # the manual sections
    assert sum(f.stat().st_size for f in (MODELS / "classify").iterdir()) < 64 * 2**20
    for name in ("LICENSE", "MODEL_CARD.md", "tokenizer.json", "TRAINING-DATA-COPYRIGHT"):
        assert (MODELS / "classify" / name).is_file()
    pages = json.loads((Path(__file__).parent / "heldout_pages.json").read_text())
    special = m.special_tokens

    def ranking(text: str) -> list[str]:
        ids = [special["cls"], *model.tokenizer.encode(text, add_special_tokens=False).ids, special["sep"]]
        logits = model.run_encoder(np.array([ids]), np.ones((1, len(ids)), np.int64))["logits"][0]
        return [m.labels[i] for i in np.argsort(-logits)]

    # held-out pages (docs/models.md: 75.9% accuracy; it tells 2 from 3, not the rare sections).
    # MB_CUR_MAX(3) wins by a wide margin (1.7 logits); getsockopt(2) by 0.15 on this machine, so
    # only its top two are asserted (int8 kernels differ between CPUs)
    assert ranking(pages["MB_CUR_MAX.3"])[0] == "3"
    assert set(ranking(pages["getsockopt.2"])[:2]) == {"2", "3"}
