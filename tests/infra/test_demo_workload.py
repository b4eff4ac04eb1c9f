"""The demo's bundled workload and how it is cut into waves (pure: no stack)."""

from __future__ import annotations

from infra.demo_workload import QUICK_WAVES, WAVES, count_requests, group_name, load_workload, plan_waves


def test_bundled_workload_has_a_few_dozen_prompts_of_every_size_and_three_workflows() -> None:
    workload = load_workload()
    assert 30 <= len(workload.prompts) <= 48
    assert {p.size for p in workload.prompts} == {"short", "medium", "long"}
    assert {p.tenant for p in workload.prompts} == {"insurance", "finance", "health"}
    assert len({p.id for p in workload.prompts}) == len(workload.prompts)
    assert len(workload.workflows) == 3
    assert all(len(w.steps) >= 3 for w in workload.workflows)


def test_waves_send_every_prompt_once_alone_4_and_12_at_once() -> None:
    workload = load_workload()
    waves = plan_waves(workload.prompts)
    assert [(at_once, len(ps)) for at_once, ps in waves] == list(WAVES)
    ids = [p.id for _, ps in waves for p in ps]
    assert len(ids) == len(set(ids)) == sum(n for _, n in WAVES)
    assert plan_waves(workload.prompts) == waves  # fixed shuffle: the same plan every run
    for _, prompts in waves[1:]:
        assert len({p.size for p in prompts}) > 1  # each batched wave mixes lengths


def test_quick_workload_is_six_prompts_and_one_workflow_of_two_steps() -> None:
    workload = load_workload(quick=True)
    waves = plan_waves(workload.prompts, quick=True)
    assert [(a, len(ps)) for a, ps in waves] == list(QUICK_WAVES)
    assert len(workload.workflows) == 1
    assert len(workload.workflows[0].steps) == 2
    assert count_requests(workload, quick=True) == 8
    assert count_requests(load_workload()) == 36 + 10


def test_group_names() -> None:
    assert group_name(1) == "alone"
    assert group_name(12) == "12 at once"
