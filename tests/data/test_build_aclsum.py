"""The out-of-domain test set (issue 27): a paper laid out as a rendered man page, so that the lead
baselines read it as they read a page."""

from data.build_aclsum import paper_record
from longdoc.export.evaluate import lead, lead_description


def paper(abstract, body):
    return {"paper_id": "7", "title": "A Title", "pdf_parse": {
        "abstract": [{"text": t} for t in abstract],
        "body_text": [{"text": t, "section": s, "sec_num": n} for n, s, t in body]}}


def test_paper_record_lays_out_sections_and_keeps_the_abstract_out_of_the_document():
    body = [("1", "Introduction", "We study  long documents. They are long."), ("1", "Introduction", "More text " * 20),
            (None, "Conclusion", "It works.")]
    r = paper_record(paper(["An abstract,", "in two parts."], body))
    assert r["summary"] == "An abstract, in two parts."
    assert r["document"].startswith("1 INTRODUCTION\n       We study long documents. They are long.\n       More text")
    assert "\nCONCLUSION\n       It works.\n" in r["document"] and "abstract" not in r["document"]
    assert lead(r["document"]) == lead_description(r["document"]) == "We study long documents."
    assert paper_record(paper([], body)) is None  # no abstract, no record
