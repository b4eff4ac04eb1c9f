"""Point the services' settings at the local stack when one is running, so commands need no flags.

``reprolane replay request ID`` on a machine where ``reprolane stack up`` ran should just work. When
``<run-dir>/stack.json`` exists (``$REPROLANE_RUN_DIR`` or ``./.reprolane/stack``), its addresses and
credentials become *defaults* for the ``REPROLANE_CAPTURE_*``, ``REPROLANE_REPLAYER_*``,
``REPROLANE_ARCHIVER_*`` and ``REPROLANE_SHIPPER_*`` settings (while its vLLM records its schedule, also the
sidecar's ``schedule_recorder`` and the shipper's directory):
anything already set in the environment, and any flag, still wins.

The operator commands (``reprolane audit hold``, ``expire``, ...) find the operator keys a demo run minted in the run
dir (`operator_defaults`: the demo's key store, and its hold-admin's key file as the caller's key) the same way,
as defaults of this process only (never handed to a service), and only while no key of the caller's own is set.

The S3 secret is handed over as a file, never as a value: the defaults name ``<run-dir>/s3_secret_key`` (0600,
`infra.stack.state.s3_secret_file`) in ``REPROLANE_*_S3_SECRET_KEY_FILE``, and each service's settings read it
(`infra.clients.connection`). So neither this process's environment nor any child's (the demo's services, vLLM)
holds it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, MutableMapping
from pathlib import Path

from infra import paths
from infra.stack.servers import SCHEDULE_FILE, VLLM_RUNTIME_FILE
from infra.stack.state import StackInfo, s3_secret_file
from schemas.manifest import MANIFEST_NAME

AUDIT_SIGNING_KEY_FILE = "audit-signing.pem"
#: Where a demo run keeps its console's operator keys (`infra.demo.services.write_console_logins` writes them):
#: the key store and, per role, the file holding that role's key.
DEMO_DIR = "demo"
DEMO_OPERATOR_KEYS = "operator-keys.json"
#: The demo's key the operator commands act with by default: the one that may place legal holds.
DEMO_OPERATOR_ROLE = "hold-admin"


def demo_operator_key_file(run_dir: Path, role: str) -> Path:
    return run_dir / DEMO_DIR / f"console-{role}.key"


def stack_defaults(info: StackInfo) -> dict[str, str]:
    """Environment defaults for both services from a stack's info."""
    common = {
        "KAFKA_BOOTSTRAP": info.kafka_bootstrap,
        "S3_ENDPOINT": info.s3_endpoint,
        "S3_ACCESS_KEY": info.s3_access_key,
        "S3_SECRET_KEY_FILE": str(s3_secret_file(info.run_dir, info.s3_secret_key)),
        "S3_REGION": info.s3_region,
        "S3_BUCKET": info.audit_bucket,
    }
    env = {f"REPROLANE_CAPTURE_{k}": v for k, v in common.items()}
    env.update({f"REPROLANE_REPLAYER_{k}": v for k, v in common.items()})
    env.update({f"REPROLANE_ARCHIVER_{k}": v for k, v in common.items()})
    env.update({f"REPROLANE_SHIPPER_{k}": v for k, v in common.items()})
    env.update({f"REPROLANE_AUDIT_{k}": v for k, v in common.items() if k.startswith("S3_")})  # verify/hold/expire
    env["REPROLANE_CAPTURE_AUDIT_LOG"] = "true"  # the publisher appends every stored envelope to the Merkle log
    signing_key = info.run_dir / AUDIT_SIGNING_KEY_FILE
    if signing_key.is_file():  # made by `reprolane keys signing <run-dir>/audit-signing.pem`
        env["REPROLANE_AUDIT_SIGNING_KEY"] = str(signing_key)
    runtime = info.run_dir / VLLM_RUNTIME_FILE
    if runtime.is_file():
        env["REPROLANE_CAPTURE_RUNTIME_PATH"] = str(runtime)
    env.update(_schedule_defaults(info.run_dir))
    if info.iceberg_url:  # the Iceberg lake's catalog (used when REPROLANE_ARCHIVER_LAKE_KIND=iceberg)
        env["REPROLANE_ARCHIVER_ICEBERG_URI"] = info.iceberg_url
    if info.vllm_url:
        env["REPROLANE_CAPTURE_UPSTREAM"] = info.vllm_url
        env["REPROLANE_REPLAYER_REMOTE_URL"] = info.vllm_url
    if info.model_dir is not None:
        env["REPROLANE_CAPTURE_MANIFEST_PATH"] = str(info.model_dir / MANIFEST_NAME)
        env["REPROLANE_REPLAYER_MODEL_DIR"] = str(info.model_dir)
        env["REPROLANE_REPLAYER_SERVED_MODEL_NAME"] = info.model_name
    return env


def _schedule_defaults(run_dir: Path) -> dict[str, str]:
    """While the stack's vLLM records its schedule (`infra.stack.servers.SCHEDULE_FILE`): the sidecar's envelopes say
    where their schedule is, and the shipper knows the directory."""
    try:
        doc = json.loads((run_dir / SCHEDULE_FILE).read_text(encoding="utf-8"))
        recorder, directory = str(doc["recorder"]), str(doc["schedule_dir"])
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return {"REPROLANE_CAPTURE_SCHEDULE_RECORDER": recorder, "REPROLANE_SHIPPER_SCHEDULE_DIR": directory}


def operator_defaults(run_dir: Path, environ: Mapping[str, str]) -> dict[str, str]:
    """After a demo run: its operator key store, and its hold-admin's key file as the caller's key unless the
    caller set a key or key file of its own (``REPROLANE_OPERATOR_KEY`` would lose to a defaulted file)."""
    env: dict[str, str] = {}
    keys = run_dir / DEMO_DIR / DEMO_OPERATOR_KEYS
    if keys.is_file():
        env["REPROLANE_OPERATOR_KEYS_PATH"] = str(keys)
    key_file = demo_operator_key_file(run_dir, DEMO_OPERATOR_ROLE)
    own = {"REPROLANE_OPERATOR_KEY", "REPROLANE_OPERATOR_KEY_FILE"} & environ.keys()
    if keys.is_file() and key_file.is_file() and not own:
        env["REPROLANE_OPERATOR_KEY_FILE"] = str(key_file)
    return env


def apply_stack_defaults(environ: MutableMapping[str, str], run_dir: Path | None = None) -> StackInfo | None:
    """Set the stack's defaults (and a demo run's operator keys, `operator_defaults`) into `environ` where unset;
    return the stack found, or None."""
    try:
        info = StackInfo.load(paths.run_dir(run_dir))
    except Exception:  # no stack, or a state file from an older layout: no defaults, never an error
        return None
    for key, value in {**stack_defaults(info), **operator_defaults(info.run_dir, environ)}.items():
        environ.setdefault(key, value)
    return info


def apply_to_process() -> StackInfo | None:
    return apply_stack_defaults(os.environ)
