"""Held-out hygiene: exact and normalized prompt overlap, refusal unless overridden."""
import pytest

from lora_kit.evaluation.hygiene import check_heldout, normalize, overlap_report

TRAIN = [{"prompt": "Date to ISO: 3 March 2021", "response": "2021-03-03"},
         {"prompt": "What is 2 + 2?", "response": "4"}]


def test_normalize_ignores_case_whitespace_punctuation():
    assert normalize("What is 2 + 2?") == normalize("what is 2+2") == "whatis22"
    assert normalize("Date to ISO:  3 March\t2021") == normalize("date to iso 3 march 2021")
    assert normalize("3 March 2021") != normalize("4 March 2021")


def test_overlap_report_counts_exact_and_normalized():
    heldout = [{"prompt": "Date to ISO: 3 March 2021", "response": "x"},   # exact
               {"prompt": "what is 2+2", "response": "4"},                  # normalized
               {"prompt": "Date to ISO: 4 March 2021", "response": "y"},   # clean
               {"prompt": "Date to ISO: 4 march 2021", "response": "y"}]   # clean, dup within held-out
    r = overlap_report(TRAIN, heldout)
    assert (r["exact"], r["normalized"], r["overlapping"], r["n_heldout"]) == (1, 1, 2, 4)
    assert r["fraction"] == 0.5 and not r["clean"]
    assert r["duplicates_within_heldout"] == 1
    assert [e["match"] for e in r["examples"]] == ["exact", "normalized"]


def test_check_heldout_refuses_unless_overridden():
    r = overlap_report(TRAIN, [{"prompt": "WHAT IS 2 + 2 ?"}])
    with pytest.raises(ValueError, match="allow_overlap=True"):
        check_heldout(r)
    marked = check_heldout(r, allow_overlap=True)
    assert marked["heldout"] is False and marked["allow_overlap"] is True
    clean = check_heldout(overlap_report(TRAIN, [{"prompt": "Date to ISO: 9 May 1999"}]))
    assert clean["heldout"] is True


def test_missing_prompt_field_is_a_clear_error():
    with pytest.raises(ValueError, match="prompt_field"):
        overlap_report(TRAIN, [{"question": "x"}])
