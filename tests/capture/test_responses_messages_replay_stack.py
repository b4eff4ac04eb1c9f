"""A Responses request (official ``openai`` client) and a streamed Messages request (official ``anthropic`` client)
through the sidecar publishing to the real stack: each envelope lands in S3 and on Kafka, and ``reprolane replay
request ID --lane remote`` (run as a user runs it) replays each by its request id from the prompt token ids and
sampling contract the envelope holds, and holds at least token level on the stack's vLLM.

Own uuid topics and consumer group (no replayer service answers for them: the CLI loads the remote lane itself);
the stack's audit bucket.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from capture.publishing.kafka_sink import KafkaSink
from capture.publishing.publisher import Publisher
from capture.publishing.s3_sink import S3Sink
from capture.request.app import build_app
from capture.spool import Spool
from infra.stack.state import StackInfo
from replayer.store import EnvelopeStore
from schemas import CapturedOutput, decode_envelope
from tests.capture.audit.conftest import eventually
from tests.capture.fake_upstream import serve
from tests.capture.keys import write_test_keys
from tests.capture.request.test_responses_messages_stack import QUESTION, responses_params, sidecar_settings
from tests.cli_process import reprolane
from tests.replayer.service_harness import Topics, worker_environment
from tests.replayer.support import S3Target

pytestmark = pytest.mark.stack


def replay_cli(env: dict[str, str], request_id: str) -> dict[str, Any]:
    done = reprolane("replay", "request", request_id, "--lane", "remote", "--json", env=env, timeout=300)
    assert done.returncode in (0, 1), done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


async def test_responses_and_messages_are_published_and_replayed_by_request_id(
    stack: StackInfo, tmp_path: Path
) -> None:
    assert stack.vllm_url is not None
    assert stack.model_dir is not None
    s3 = S3Target.from_stack(stack)
    topics = await Topics.create(stack.kafka_bootstrap, s3)
    keys = write_test_keys(tmp_path)
    settings = sidecar_settings(
        stack,
        tmp_path,
        keys.path,
        kafka_bootstrap=stack.kafka_bootstrap,
        s3_endpoint=stack.s3_endpoint,
        s3_access_key=stack.s3_access_key,
        s3_secret_key=stack.s3_secret_key,
        s3_region=stack.s3_region,
        s3_bucket=s3.bucket,
    )
    spool = Spool(settings.spool_dir, max_bytes=settings.spool_max_bytes)
    sinks = [KafkaSink(settings, topic=topics.names["envelope_topic"]), S3Sink(settings)]
    publisher = Publisher(spool, settings, sinks=sinks, idle_poll_s=0.05)
    async with serve(build_app(settings, spool=spool, publisher=publisher)) as url:
        oa = openai.AsyncOpenAI(base_url=url + "/v1", api_key=keys.bank, max_retries=0)
        an = anthropic.AsyncAnthropic(base_url=url, auth_token=keys.bank, api_key=None, max_retries=0)
        try:
            raw = await oa.responses.with_raw_response.create(**responses_params(stack))
            responses_id = raw.headers["x-reprolane-request-id"]
            streamed = await an.messages.with_raw_response.create(
                model=stack.model_name,
                messages=[{"role": "user", "content": QUESTION}],
                max_tokens=5,
                stream=True,
                extra_body={"temperature": 0},
            )
            async for _ in await streamed.parse():
                pass
            messages_id = streamed.headers["x-reprolane-request-id"]
        finally:
            await oa.close()
            await an.close()
        await eventually(lambda: spool.depth == 0, 60, "the sidecar's publishing")

    store = EnvelopeStore(s3.client(), s3.bucket)
    envs = {rid: store.get_by_request_id(rid) for rid in (responses_id, messages_id)}
    assert [envs[rid].endpoint for rid in (responses_id, messages_id)] == ["responses", "messages"]
    assert all(env.replayable and isinstance(env.outcome, CapturedOutput) for env in envs.values())
    on_kafka = [decode_envelope(r.value) for r in await topics.consume("envelope_topic", 3)]
    finished = {env.request_id: env for env in on_kafka if not env.is_started_record}
    assert finished == envs  # the same records on both sinks (the stream's started record is on Kafka too)

    env = {**worker_environment(topics.settings(remote_url=stack.vllm_url, served_model_name=stack.model_name))}
    env["REPROLANE_RUN_DIR"] = str(stack.run_dir)
    for rid, recorded in envs.items():
        result = await asyncio.to_thread(replay_cli, env, rid)
        event = result["event"]
        assert (event["request_id"], event["envelope_id"], event["lane"]) == (rid, recorded.envelope_id(), "remote")
        assert "token" in event["levels_held"], event
        assert isinstance(recorded.outcome, CapturedOutput)
        assert result["replayed"]["token_ids"] == list(recorded.outcome.choices[0].token_ids)
