from __future__ import annotations

from schemas import ArtifactHashes, EnvironmentFingerprint, decode_environment, diff_environments
from tests.factories import FIXED_TIME, runtime


def env(**runtime_overrides: object) -> EnvironmentFingerprint:
    return EnvironmentFingerprint(
        model_name="m",
        artifacts=ArtifactHashes(model_sha256="a" * 64, tokenizer_sha256="b" * 64, chat_template_sha256="c" * 64),
        runtime=runtime(**runtime_overrides),
        taken_at=FIXED_TIME,
        source="local",
    )


def test_identity_ignores_when_and_where() -> None:
    a = env()
    b = a.model_copy(update={"taken_at": FIXED_TIME.replace(year=2027), "source": "elsewhere"})
    assert a.sha256() == b.sha256()
    assert diff_environments(a, b) == ()
    assert decode_environment(a.model_dump_json()) == a


def test_every_listed_field_is_named_in_the_diff() -> None:
    a = env()
    b = env(engine_version="0.33.0", cuda_version="13.0", attention_backend="FLASH_ATTN").model_copy(
        update={"artifacts": a.artifacts.model_copy(update={"chat_template_sha256": "d" * 64})}
    )
    fields = [d.field for d in diff_environments(a, b)]
    assert fields == [
        "artifacts.chat_template_sha256",
        "runtime.engine_version",
        "runtime.cuda_version",
        "runtime.attention_backend",
    ]
    assert a.sha256() != b.sha256()


def test_unknown_counts_as_a_difference_for_a_gate() -> None:
    assert [d.field for d in diff_environments(env(), env(torch_version=None))] == ["runtime.torch_version"]
