from __future__ import annotations

from schemas import diff_fingerprints
from schemas.fingerprint import cpu_model_name_of
from tests.factories import runtime


def test_identical_fingerprints_have_no_diff_and_same_hash() -> None:
    assert diff_fingerprints(runtime(), runtime()) == ()
    assert runtime().sha256() == runtime().sha256()


def test_diff_names_exactly_the_changed_fields() -> None:
    lane = runtime(max_num_seqs=1, prefix_caching=False, dtype="bfloat16", system_fingerprint="other")
    diffs = diff_fingerprints(runtime(), lane)
    assert [d.field for d in diffs] == ["max_num_seqs", "prefix_caching"]
    assert (diffs[0].recorded, diffs[0].replayed) == (256, 1)
    assert lane.sha256() != runtime().sha256()


def test_unknown_is_not_a_change_unless_asked() -> None:
    lane = runtime(attention_backend=None)
    assert diff_fingerprints(runtime(), lane) == ()
    assert [d.field for d in diff_fingerprints(runtime(), lane, include_unknown=True)] == ["attention_backend"]


def test_vendor_version_is_a_real_change() -> None:
    """A hosted API that silently swaps the model behind an alias must trigger the gate and the replay diff."""
    a = runtime(engine="unknown", vendor_version="model=gpt-x-2026-01-01;openai-version=2020-10-01")
    b = runtime(engine="unknown", vendor_version="model=gpt-x-2026-03-01;openai-version=2020-10-01")
    assert [d.field for d in diff_fingerprints(a, b)] == ["vendor_version"]


def test_a_cpu_is_named_by_the_first_model_name_line_of_cpuinfo() -> None:
    """The recorder and the lanes both spell ``device_name`` this way; a drift would read as a changed CPU."""
    cpuinfo = ["processor\t: 0\n", "model name\t: AMD EPYC 9554 64-Core Processor\n", "model name\t: other\n"]
    assert cpu_model_name_of(cpuinfo) == "AMD EPYC 9554 64-Core Processor"
    assert cpu_model_name_of(["model name\t:   \n"]) == ""  # named, but empty: the caller says "unknown"
    assert cpu_model_name_of(["processor\t: 0\n", "Hardware\t: BCM2835\n"]) is None  # no line: ask the platform
