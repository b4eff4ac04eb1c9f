"""A model whose ``generation_config.json`` sets sampling defaults, served by a real vLLM of its own.

vLLM applies those defaults to every request that leaves the fields out (its default ``--generation-config
auto``) and says so in its log. The sidecar, given the model's manifest, must record the same values in the
envelope's contract: before, it recorded vLLM's built-in ones (temperature 1.0, no length limit), so an envelope
of a greedy, 5-token request read as a sampled request whose randomness cannot be replayed.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import openai
import pytest

from capture.request.app import build_app
from capture.settings import CaptureSettings
from capture.spool import Spool
from infra import paths
from infra.model.manifest import load_manifest, write_manifest
from infra.stack.state import StackInfo
from schemas.manifest import MANIFEST_NAME
from tests.capture.fake_upstream import serve
from tests.capture.request.test_app_stack import envelope_of
from tests.private_vllm import launched_vllm

pytestmark = [pytest.mark.stack, pytest.mark.own_engines]

MODEL_DEFAULTS = {"temperature": 0.0, "top_k": 7, "max_new_tokens": 5}
_OVERRIDDEN = re.compile(r"Default vLLM sampling parameters have been overridden by .*?: `(\{.*?\})`")


@pytest.fixture(scope="module")
def vllm_with_defaults(stack: StackInfo, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Path]]:
    """(vLLM url, the model's manifest, vLLM's log) of a private vLLM serving a copy of the model whose
    generation_config.json sets `MODEL_DEFAULTS`; stopped at the end of the module."""
    assert stack.model_dir is not None
    cache = tmp_path_factory.mktemp("cache")
    target = paths.model_dir(cache)
    shutil.copytree(stack.model_dir, target)
    config = target / "generation_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), **MODEL_DEFAULTS}))
    original = load_manifest(target)
    write_manifest(
        target,
        model_name=original.model_name,
        source=original.source,
        dtype=original.dtype,
        chat_template=(target / "chat_template.jinja").read_text(encoding="utf-8"),
        created_at=datetime.now(UTC),
    )
    run_dir = tmp_path_factory.mktemp("vllm-defaults")
    with launched_vllm(run_dir, cache_dir=cache) as url:
        yield url, target / MANIFEST_NAME, run_dir / "logs" / "vllm.log"


async def test_the_models_sampling_defaults_are_recorded_as_vllm_applies_them(
    stack: StackInfo, vllm_with_defaults: tuple[str, Path, Path], tmp_path: Path
) -> None:
    url, manifest, log = vllm_with_defaults
    found = _OVERRIDDEN.search(log.read_text(errors="replace"))
    assert found is not None, "vLLM did not report taking defaults from generation_config.json"
    applied = ast.literal_eval(found.group(1))
    assert applied == {"temperature": 0.0, "top_k": 7, "max_tokens": 5}

    settings = CaptureSettings(upstream=url, spool_dir=tmp_path / "spool", manifest_path=manifest)
    spool = Spool(settings.spool_dir, max_bytes=settings.spool_max_bytes)
    messages: list[dict[str, str]] = [{"role": "user", "content": "Tell me a story about a fox."}]
    async with serve(build_app(settings, spool=spool)) as sidecar_url:
        client = openai.AsyncOpenAI(base_url=sidecar_url + "/v1", api_key="sk-x", max_retries=0)
        try:
            raw = await client.chat.completions.with_raw_response.create(
                model=stack.model_name,
                messages=messages,  # type: ignore[arg-type]
            )
        finally:
            await client.close()
        answer = raw.parse()
        env = await envelope_of(spool, raw.headers["x-reprolane-request-id"])
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage is not None
    assert answer.usage.completion_tokens == 5  # vLLM did apply the model's max_new_tokens
    contract = env.sampling
    assert contract is not None
    assert {name: getattr(contract, name) for name in applied} == applied
    assert contract.seed_scope == "none"  # greedy: replayable token for token
