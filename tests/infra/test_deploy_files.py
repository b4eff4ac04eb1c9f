"""The deployment files, checked without a Docker engine or any server.

- docker-compose.yml against the Compose Specification schema (the copy check-jsonschema vendors), raw and
  after interpolating its defaults; pinned images, loopback-only ports, internal networks, secrets from files;
- every ``reprolane ...`` command line of a service parsed by the real CLI (`infra.cli.root.app`), and every
  ``REPROLANE_*`` variable of a service fed to the real settings object of that service;
- the image entrypoint's secret-file handling and the topic script, run with stand-ins for their tools;
- Prometheus config and rules through ``promtool check`` and ``promtool test rules`` (alerts.test.yml), and
  every metric and label that alerts and dashboards name, against the metric definitions in the code;
- Grafana dashboards: JSON, panels, and each PromQL expression parsed by promtool.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import typer.main
import yaml

from capture.audit.checkpointer import CheckpointerMetrics
from capture.metrics import CaptureMetrics
from capture.schedule.shipper_metrics import ShipperMetrics
from infra import paths
from replayer.metrics import ReplayerMetrics
from schemas import RuntimeFingerprint
from schemas.layout import ALL_TOPICS

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
INFRA = ROOT / "infra"
PROMETHEUS = INFRA / "prometheus"
DASHBOARDS = INFRA / "grafana" / "dashboards"
SECRETS = INFRA / "secrets"

# The settings object each REPROLANE_ prefix configures (the service reads it with pydantic-settings).
SETTINGS_BY_PREFIX = {
    "REPROLANE_CAPTURE_": "capture.settings:CaptureSettings",
    "REPROLANE_REPLAYER_": "replayer.settings:ReplayerSettings",
    "REPROLANE_ARCHIVER_": "capture.audit.lake.settings:LakeSettings",
    "REPROLANE_SHIPPER_": "capture.schedule.shipper_settings:ShipperSettings",
}
# Variables read directly (not through a settings object).
PLAIN_ENV = frozenset({paths.CACHE_DIR_ENV, paths.RUN_DIR_ENV})
# Series that come from other exporters, not from our code: name -> where they come from.
EXTERNAL_METRICS = {
    "up": "Prometheus itself",
    "kafka_consumergroup_lag": "kafka-exporter (docker-compose.yml)",
    "kafka_topic_partition_current_offset": "kafka-exporter (docker-compose.yml)",
}
ALWAYS_LABELS = frozenset({"job", "instance", "le"})
_INTERPOLATION = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)([^}]*))?\}")


# ------------------------------------------------------------------------------------------------ helpers


def _compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return data


def interpolate(value: Any, env: dict[str, str] | None = None) -> Any:
    """Compose's ``${VAR}``, ``${VAR-default}`` and ``${VAR:-default}``, with ``env`` (default: nothing set)."""
    env = env or {}
    if isinstance(value, str):

        def sub(m: re.Match[str]) -> str:
            name, op, default = m.group(1), m.group(2), m.group(3) or ""
            if name in env and (op != ":-" or env[name]):
                return env[name]
            return default

        return _INTERPOLATION.sub(sub, value)
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    return value


def _compose_schema() -> dict[str, Any]:
    text = resources.files("check_jsonschema.builtin_schemas.vendor").joinpath("compose-spec.json").read_text("utf-8")
    schema = json.loads(text)
    assert isinstance(schema, dict)
    return schema


def _schema_errors(document: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft202012Validator(_compose_schema())
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document)]


def _services() -> dict[str, dict[str, Any]]:
    services = _compose()["services"]
    assert isinstance(services, dict)
    return services


def _reprolane_services() -> list[str]:
    return sorted(name for name, svc in _services().items() if (svc.get("command") or [None])[0] == "reprolane")


def _env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    assert isinstance(env, dict), "environment must be a mapping (KEY: value), not a list"
    return {str(k): str(v) for k, v in interpolate(env).items()}


def _parse_cli(argv: list[str]) -> dict[str, Any]:
    """Parse ``reprolane ARGV`` with the real app, down to the leaf command, without running it."""
    from infra.cli.root import app

    command = typer.main.get_command(app)
    path = ["reprolane"]
    rest = list(argv)
    while hasattr(command, "commands"):  # a group: ask it (the root loads its commands on demand)
        ctx = command.make_context(path[-1], [], resilient_parsing=True)
        names = sorted(command.list_commands(ctx))
        assert rest, f"`{' '.join(path)}` needs a subcommand; it has {names}"
        name = rest.pop(0)
        assert name in names, f"`{' '.join(path)}` has no command {name!r}; it has {names}"
        command = command.get_command(ctx, name)
        path.append(name)
    ctx = command.make_context(path[-1], rest)
    return dict(ctx.params)


def _promtool() -> str:
    found = shutil.which("promtool")
    assert found, "promtool not found: install Debian's `prometheus` package (apt-get install prometheus)"
    return found


def _metric_labels() -> dict[str, frozenset[str]]:
    """Every series name our code can expose (with _total/_bucket/... suffixes) -> its label names."""
    out: dict[str, frozenset[str]] = {}
    suffixes = {
        "counter": ("_total", "_created"),
        "gauge": ("",),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
    }
    for owner in (CaptureMetrics(), ReplayerMetrics(), CheckpointerMetrics(), ShipperMetrics()):
        for metric in vars(owner).values():
            kind = getattr(metric, "_type", None)
            if kind not in suffixes:
                continue
            # prometheus_client keeps the declared label names here; there is no public accessor.
            labels = frozenset(metric._labelnames) | ALWAYS_LABELS
            for suffix in suffixes[kind]:
                out[metric._name + suffix] = labels
    return out


def _rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text(encoding="utf-8"))
    return [rule for group in doc["groups"] for rule in group["rules"]]


def _dashboards() -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in sorted(DASHBOARDS.glob("*.json")):
        yield path, json.loads(path.read_text(encoding="utf-8"))


def _dashboard_exprs() -> list[tuple[str, str]]:
    out = []
    for path, dash in _dashboards():
        for panel in dash["panels"]:
            for target in panel.get("targets", []):
                out.append((f"{path.name}: {panel['title']}", target["expr"]))
    return out


def _grafana_to_promql(expr: str) -> str:
    """Replace Grafana's variables by values promtool can parse."""
    expr = expr.replace("$__rate_interval", "5m").replace("$__range", "1h").replace("$__interval", "1m")
    return re.sub(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?", ".*", expr)


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_NAME = re.compile(r"(?<![A-Za-z0-9_:.$])([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\{[^}]*\}|\[|\)|\s|$|[-+*/><=!])")
_KEYWORDS = frozenset(
    "sum avg min max count rate increase delta irate histogram_quantile by without on ignoring group_left "
    "group_right and or unless label_replace vector scalar predict_linear bool offset topk bottomk abs clamp_min "
    "clamp_max time deriv".split()
)


def referenced_series(expr: str) -> dict[str, set[str]]:
    """Metric names an expression selects -> label names used in their selectors (string literals ignored)."""
    found: dict[str, set[str]] = {}
    for m in _NAME.finditer(expr):
        name, after = m.group(1), m.group(2)
        if name in _KEYWORDS or name.startswith("__"):
            continue
        before = expr[: m.start()].rstrip()
        if before.endswith(("by (", "by(", "on (", "on(", ",")) and not after.startswith("{"):
            continue  # a label in a grouping clause, checked separately
        labels = set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", _STRING.sub('""', after)))
        found.setdefault(name, set()).update(labels)
    return found


def grouping_labels(expr: str) -> set[str]:
    out: set[str] = set()
    for clause in re.findall(r"\b(?:by|on|without|ignoring)\s*\(([^)]*)\)", expr):
        out.update(x.strip() for x in clause.split(",") if x.strip())
    return out


def _check_promql_names(where: str, expr: str, known: dict[str, frozenset[str]], recorded: set[str]) -> list[str]:
    problems = []
    stripped = _STRING.sub('""', expr)
    series = referenced_series(stripped)
    # label_replace's target label and the thresholds' label are introduced by the rules themselves
    introduced = set(re.findall(r'label_replace\([^,]+,\s*"([^"]+)"', expr))
    usable = set(ALWAYS_LABELS) | introduced
    for name, labels in series.items():
        if name in known:
            usable |= known[name]
            bad = labels - known[name]
            if bad:
                problems.append(f"{where}: {name} has no label(s) {sorted(bad)} (it has {sorted(known[name])})")
        elif name in recorded or name in EXTERNAL_METRICS:
            usable |= {"target_level", "runtime_fingerprint", "consumergroup", "topic", "partition"} | labels
        else:
            problems.append(f"{where}: unknown metric {name!r}")
    for label in grouping_labels(stripped) - usable:
        problems.append(f"{where}: groups by {label!r}, which none of its metrics has")
    return problems


# ------------------------------------------------------------------------------------------------ compose


def test_compose_validates_against_the_compose_spec() -> None:
    document = _compose()
    assert _schema_errors(document) == []
    assert _schema_errors(interpolate(document)) == []


def test_compose_schema_check_rejects_a_broken_file() -> None:
    """The schema check above must be able to fail: an unknown key and a bad dependency condition."""
    broken = _compose()
    broken["services"]["kafka"]["helthcheck"] = {"test": ["CMD", "true"]}
    broken["services"]["kafka-init"]["depends_on"]["kafka"]["condition"] = "healthy"
    errors = _schema_errors(broken)
    assert any("helthcheck" in e for e in errors), errors
    assert any("depends_on" in e for e in errors), errors


def test_every_image_is_pinned_to_an_exact_version() -> None:
    for name, svc in _services().items():
        image = interpolate(svc.get("image", ""))
        assert image, f"{name}: no image"
        repo, _, tag = image.rpartition(":")
        assert repo, f"{name}: image {image!r} has no tag"
        assert tag, f"{name}: image {image!r} has no tag"
        assert "/" not in tag, f"{name}: image {image!r} has no tag"
        assert tag not in {"latest", "stable", "main"}, f"{name}: floating tag {image!r}"
        if "build" in svc:
            assert svc["build"]["dockerfile"].startswith("infra/docker/"), name
        else:
            assert re.search(r"\d", tag), f"{name}: {image!r} is not an exact version"


def test_profiles_run_the_same_topology() -> None:
    services = _services()
    roles = {}
    for profile in ("gpu", "cpu"):
        names = {n for n, s in services.items() if profile in s.get("profiles", [])}
        roles[profile] = {n.removesuffix(f"-{profile}") for n in names}
    assert roles["gpu"] == roles["cpu"] == {"model-fetch", "vllm", "capture", "replayer"}
    for role in ("vllm", "capture", "replayer"):
        aliases = [
            {a for net in services[f"{role}-{p}"]["networks"].values() if net for a in net.get("aliases", [])}
            for p in ("gpu", "cpu")
        ]
        assert aliases[0] == aliases[1], f"{role}: both profiles must carry the same aliases"
        assert role in aliases[0], f"{role}: both profiles must carry alias {role!r}"
    shared = {n for n, s in services.items() if not s.get("profiles")}
    assert {"kafka", "kafka-init", "minio", "minio-init", "archiver", "prometheus", "grafana"} <= shared


def test_gpu_replay_lane_is_deterministic_and_on_its_own_gpu() -> None:
    services = _services()
    replayer = services["replayer-gpu"]
    env = _env(replayer)
    assert env["VLLM_BATCH_INVARIANT"] == "1"
    assert env["CUBLAS_WORKSPACE_CONFIG"] in {":4096:8", ":16:8"}
    assert env["REPROLANE_REPLAYER_LANE"] == "vllm"
    gpu_of = {n: interpolate(services[n]["gpus"][0]["device_ids"]) for n in ("vllm-gpu", "replayer-gpu")}
    assert gpu_of["vllm-gpu"] != gpu_of["replayer-gpu"], "production and replay lanes must not share a GPU"
    # one engine version for both lanes: the build args come from one anchor
    versions = {interpolate(services[n]["build"]["args"]["VLLM_VERSION"]) for n in services if "build" in services[n]}
    assert len(versions) == 1


def test_ports_are_published_on_loopback_only() -> None:
    published = {}
    for name, svc in _services().items():
        assert svc.get("network_mode") != "host", name
        for port in svc.get("ports", []):
            assert isinstance(port, str), f'{name}: {port!r} (use the "HOST:PUBLISHED:TARGET" string form)'
            assert interpolate(port).startswith("127.0.0.1:"), f"{name}: {port!r}"
            published[name] = port
    assert set(published) == {"capture-gpu", "capture-cpu", "prometheus", "grafana"}


def test_only_edge_and_egress_networks_leave_the_host() -> None:
    compose = _compose()
    open_networks = {n for n, net in compose["networks"].items() if not (net or {}).get("internal")}
    assert open_networks == {"edge", "egress"}
    for name, svc in _services().items():
        nets = set(svc.get("networks") or [])
        assert nets, f"{name}: no network (it would join the default, non-internal one)"
        if "egress" in nets:
            assert name.startswith("model-fetch-"), f"{name}: only the model fetch may reach out"
        if "edge" in nets:
            assert svc.get("ports"), f"{name}: on the edge network without publishing anything"


def test_credentials_come_from_secret_files() -> None:
    compose = _compose()
    declared = compose["secrets"]
    for secret in declared.values():
        example = ROOT / (secret["file"] + ".example")
        assert example.is_file(), f"{example} is missing"
    for name, svc in _services().items():
        for key, value in _env(svc).items():
            if re.search(r"PASSWORD|SECRET|ACCESS_KEY", key) and value:
                assert key.endswith(("_FILE", "__FILE")), f"{name}: {key} carries a credential in the environment"
                secret = Path(value).name
                assert value == f"/run/secrets/{secret}", f"{name}: {key}"
                assert secret in svc.get("secrets", []), f"{name}: {key} names a secret the service does not mount"
    ignore = (SECRETS / ".gitignore").read_text(encoding="utf-8")
    assert "*" in ignore.splitlines()
    assert "!*.example" in ignore.splitlines()


@pytest.mark.parametrize("service", _reprolane_services())
def test_service_command_parses_with_the_real_cli(service: str) -> None:
    argv = _services()[service]["command"]
    _parse_cli(interpolate(argv)[1:])


def test_cli_parse_helper_rejects_unknown_commands_and_options() -> None:
    from typer import TyperException

    with pytest.raises(AssertionError, match="no command"):
        _parse_cli(["no-such-group", "serve"])
    with pytest.raises(TyperException):
        _parse_cli(["model", "fetch", "--no-such-option"])


def _settings_class(prefix: str) -> Any:
    module, cls_name = SETTINGS_BY_PREFIX[prefix].split(":")
    return getattr(importlib.import_module(module), cls_name)


def _service_settings(service: str, monkeypatch: pytest.MonkeyPatch, secret_dir: Path | None) -> list[Any]:
    """Build the settings objects of `service` from its compose environment, as the entrypoint hands it over:
    each ``/run/secrets/NAME`` is `secret_dir`/NAME, or the committed example file when `secret_dir` is None."""
    env = _env(_services()[service])
    for key in list(os.environ):
        if key.startswith("REPROLANE_"):
            monkeypatch.delenv(key)
    prefixes = {p for p in SETTINGS_BY_PREFIX if any(k.startswith(p) for k in env)}
    unknown = {
        k
        for k in env
        if k.startswith("REPROLANE_") and k not in PLAIN_ENV and not any(k.startswith(p) for p in SETTINGS_BY_PREFIX)
    }
    assert not unknown, f"{service}: no settings object known for {sorted(unknown)} (add it to SETTINGS_BY_PREFIX)"
    for key, value in env.items():
        if key.endswith("_FILE") and key.startswith("REPROLANE_"):
            name = Path(value).name
            value = str(SECRETS / f"{name}.example" if secret_dir is None else secret_dir / name)
        if value:
            monkeypatch.setenv(key, value)
    built = []
    for prefix in prefixes:
        cls = _settings_class(prefix)
        fields = set(cls.model_fields)
        for key in env:
            if key.startswith(prefix):
                field = key.removeprefix(prefix).lower()
                assert field in fields, f"{service}: {key} sets no field of {cls.__name__} (a typo is silently ignored)"
        built.append(cls())  # validates every value (types, literals, ranges) and reads the secret files
    return built


def _own_secrets(tmp_path: Path) -> Path:
    """A secret directory holding a value of one's own for every compose secret."""
    out = tmp_path / "secrets"
    out.mkdir()
    for name in _compose()["secrets"]:
        (out / name).write_text(f"own-{name}-value\n", encoding="utf-8")
    return out


@pytest.mark.parametrize("service", _reprolane_services())
def test_service_environment_builds_its_settings(service: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """What the entrypoint hands the process (secret *files*, empty values dropped) builds the real settings,
    and the settings read each secret from its file: no secret value is in the environment."""
    secrets = _own_secrets(tmp_path)
    for settings in _service_settings(service, monkeypatch, secrets):
        for field in ("s3_secret_key", "kafka_sasl_password"):
            if field in type(settings).model_fields and getattr(settings, f"{field}_file") is not None:
                assert getattr(settings, field).get_secret_value().startswith("own-")
    leaked = {k for k, v in os.environ.items() if k.startswith("REPROLANE_") and v.startswith("own-")}
    assert not leaked


@pytest.mark.parametrize("service", [n for n in _reprolane_services() if _services()[n].get("secrets")])
def test_service_refuses_the_example_secrets(service: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Copied as they are, the committed *.example secrets do not start a service: the error names the field
    and the file to change."""
    with pytest.raises(ValueError, match=r"is the committed example value: change the file .*\.example"):
        _service_settings(service, monkeypatch, None)


def test_every_example_secret_is_refused() -> None:
    from infra.clients.connection import EXAMPLE_SECRETS

    identities = {"minio_root_user.example", "s3_access_key.example"}  # user names, not secrets
    identities.add("capture_api_keys.json.example")  # hashes only, and its one entry matches no key (README there)
    identities.add("replay_request_keys.json.example")  # JSON: its placeholder secret is refused on load (below)
    values = {p.read_text(encoding="utf-8").strip() for p in SECRETS.glob("*.example") if p.name not in identities}
    assert "" not in values, "an empty example would be taken for 'unset', not refused"
    assert values <= EXAMPLE_SECRETS, (
        f"add {sorted(values - EXAMPLE_SECRETS)} to infra.clients.connection.EXAMPLE_SECRETS"
    )


def _kafka_clients() -> dict[str, dict[str, str]]:
    """Every compose service that talks to Kafka -> its Kafka client settings (prefix removed)."""
    out = {}
    for name in _reprolane_services():
        env = _env(_services()[name])
        kafka = {
            key.split("_KAFKA_", 1)[1]: value
            for key, value in env.items()
            if "_KAFKA_" in key and key.startswith(tuple(SETTINGS_BY_PREFIX))
        }
        if kafka:
            out[name] = kafka
    return out


def _script_users() -> dict[str, str]:
    """create-topics.sh's Kafka users -> their password secret."""
    text = (INFRA / "kafka" / "create-topics.sh").read_text(encoding="utf-8")
    return dict(re.findall(r'^\s+"([a-z]+)\|([a-z_]+)\|', text, re.MULTILINE))


def test_every_kafka_client_authenticates_as_its_own_user() -> None:
    clients = _kafka_clients()
    assert set(clients) == {"capture-gpu", "capture-cpu", "replayer-gpu", "replayer-cpu", "archiver", "shipper"}
    users = _script_users()
    assert set(users) == {"capture", "shipper", "replayer", "archiver", "monitor"}
    for name, kafka in clients.items():
        assert kafka["SECURITY_PROTOCOL"] in {"SASL_PLAINTEXT", "SASL_SSL"}, f"{name}: {kafka['SECURITY_PROTOCOL']}"
        assert kafka["SASL_MECHANISM"] == "SCRAM-SHA-512", name
        user = kafka["SASL_USERNAME"]
        assert user == name.removesuffix("-gpu").removesuffix("-cpu"), f"{name}: logs in as {user!r}"
        assert kafka["SASL_PASSWORD_FILE"] == f"/run/secrets/{users[user]}", name
        assert users[user] in _services()[name]["secrets"], f"{name}: does not mount its password"
        others = {s for u, s in users.items() if u != user}
        assert not others & set(_services()[name]["secrets"]), f"{name}: mounts another user's Kafka password"
    # with TLS asked for, every client switches: the protocol comes from one variable
    tls = {n: interpolate(_services()[n]["environment"], {"KAFKA_SECURITY_PROTOCOL": "SASL_SSL"}) for n in clients}
    assert all(any(v == "SASL_SSL" for v in env.values()) for env in tls.values())


def test_the_broker_requires_sasl_and_acls() -> None:
    kafka = _services()["kafka"]
    assert kafka["command"] == ["/bin/bash", "/opt/reprolane/start-broker.sh"]
    assert "kafka_admin_password" in kafka["secrets"]
    script = (INFRA / "kafka" / "start-broker.sh").read_text(encoding="utf-8")
    for line in (
        "listeners=SASL://0.0.0.0:9092,CONTROLLER://127.0.0.1:9093",
        "listener.security.protocol.map=SASL:SASL_PLAINTEXT,CONTROLLER:PLAINTEXT",
        "authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        "allow.everyone.if.no.acl.found=false",
        "sasl.enabled.mechanisms=$MECHANISM",
    ):
        assert f"\n{line}\n" in script, line
    assert "PLAINTEXT://" not in script  # no unauthenticated listener off the loopback
    exporter = " ".join(_services()["kafka-exporter"]["command"])
    assert "--sasl.enabled" in exporter
    assert "--sasl.username=monitor" in exporter


def test_broker_script_writes_a_sasl_config_and_refuses_an_example_password(tmp_path: Path) -> None:
    calls = tmp_path / "calls"
    for tool in ("kafka-storage.sh", "kafka-server-start.sh"):
        stub = tmp_path / tool
        stub.write_text(f'#!/bin/bash\necho "{tool} $*" >> {calls}\n', encoding="utf-8")
        stub.chmod(0o755)
    password = tmp_path / "admin"
    password.write_text("own-admin-password\n", encoding="utf-8")
    config, admin = tmp_path / "server.properties", tmp_path / "admin.properties"
    env = {
        "PATH": os.environ["PATH"],
        "KAFKA_BIN": str(tmp_path),
        "KAFKA_CONFIG": str(config),
        "ADMIN_CONFIG": str(admin),
        "KAFKA_ADMIN_PASSWORD_FILE": str(password),
        "CLUSTER_ID": "cmVwcm9sYW5lLWxvY2FsMQ",
    }
    script = str(INFRA / "kafka" / "start-broker.sh")
    subprocess.run(["bash", script], env=env, check=True, capture_output=True)
    lines = calls.read_text(encoding="utf-8").splitlines()
    assert "--add-scram SCRAM-SHA-512=[name=admin,password=own-admin-password]" in lines[0]
    assert lines[1] == f"kafka-server-start.sh {config}"
    assert 'username="admin" password="own-admin-password"' in config.read_text(encoding="utf-8")
    assert config.stat().st_mode & 0o077 == 0
    assert admin.stat().st_mode & 0o077 == 0
    password.write_text((SECRETS / "kafka_admin_password.example").read_text(encoding="utf-8"), encoding="utf-8")
    refused = subprocess.run(["bash", script], env=env, capture_output=True, text=True)
    assert refused.returncode == 2
    assert "example value" in refused.stderr


def test_runtime_files_are_runtime_fingerprints() -> None:
    files = sorted((INFRA / "runtime").glob("*.json"))
    assert [f.name for f in files] == ["vllm-cpu.json", "vllm-gpu.json"]
    for path in files:
        RuntimeFingerprint.model_validate_json(path.read_text(encoding="utf-8"))
    used = {_env(s).get("REPROLANE_CAPTURE_RUNTIME_PATH") for s in _services().values()} - {None}
    assert used == {f"/etc/reprolane/runtime/{f.name}" for f in files}


def test_entrypoint_keeps_secrets_in_files_and_drops_empty_values(tmp_path: Path) -> None:
    """The entrypoint never turns a secret file into an environment variable: the settings read the file."""
    secret, empty = tmp_path / "secret", tmp_path / "empty"
    secret.write_text("s3cr3t value\n", encoding="utf-8")
    empty.write_text("", encoding="utf-8")
    env = {
        "PATH": os.environ["PATH"],
        "REPROLANE_CAPTURE_S3_SECRET_KEY_FILE": str(secret),
        "REPROLANE_CAPTURE_KAFKA_SASL_PASSWORD_FILE": str(empty),
        "REPROLANE_CAPTURE_KAFKA_SASL_MECHANISM": "",
        "REPROLANE_CAPTURE_PORT": "8100",
    }
    script = str(INFRA / "docker" / "entrypoint.sh")
    out = subprocess.run(["sh", script, "env"], env=env, capture_output=True, text=True, check=True).stdout
    got = dict(line.split("=", 1) for line in out.splitlines() if line.startswith("REPROLANE_"))
    assert got == {
        "REPROLANE_CAPTURE_S3_SECRET_KEY_FILE": str(secret),
        "REPROLANE_CAPTURE_KAFKA_SASL_PASSWORD_FILE": str(empty),
        "REPROLANE_CAPTURE_PORT": "8100",
    }
    assert "s3cr3t" not in out
    env["REPROLANE_CAPTURE_S3_ACCESS_KEY_FILE"] = str(tmp_path / "missing")
    failed = subprocess.run(["sh", script, "env"], env=env, capture_output=True, text=True)
    assert failed.returncode == 2
    assert "REPROLANE_CAPTURE_S3_ACCESS_KEY_FILE" in failed.stderr


def test_topic_script_creates_the_layout_topics(tmp_path: Path) -> None:
    calls = tmp_path / "calls"
    for tool in ("kafka-topics.sh", "kafka-configs.sh"):
        stub = tmp_path / tool
        stub.write_text(
            f'#!/bin/bash\necho "{tool} $*" >> {calls}\n'
            '[[ "$*" == *--describe* ]] && echo "Topic: t PartitionCount: 1 ReplicationFactor: 1"\nexit 0\n',
            encoding="utf-8",
        )
        stub.chmod(0o755)
    env = {"PATH": os.environ["PATH"], "KAFKA_BIN": str(tmp_path), "ENVELOPE_PARTITIONS": "12"}
    subprocess.run(["bash", str(INFRA / "kafka" / "create-topics.sh")], env=env, check=True, capture_output=True)
    lines = calls.read_text(encoding="utf-8").splitlines()
    created = [re.search(r"--topic (\S+)", line).group(1) for line in lines if "--create" in line]  # type: ignore[union-attr]
    assert sorted(created) == sorted(ALL_TOPICS)
    envelope = next(line for line in lines if "--create" in line and "envelopes" in line)
    assert "--partitions 12" in envelope
    assert int(re.search(r"max.message.bytes=(\d+)", envelope).group(1)) >= 4 * 1024 * 1024  # type: ignore[union-attr]
    assert any("--alter --topic reprolane.envelopes.v1 --partitions 12" in line for line in lines)


def test_topic_script_logs_in_as_admin_and_grants_each_user_its_topics(tmp_path: Path) -> None:
    calls, secrets = tmp_path / "calls", tmp_path / "secrets"
    secrets.mkdir()
    for user in ("admin", "capture", "shipper", "replayer", "archiver", "monitor"):
        (secrets / f"kafka_{user}_password").write_text(f"pw-{user}\n", encoding="utf-8")
    for tool in ("kafka-topics.sh", "kafka-configs.sh", "kafka-acls.sh"):
        stub = tmp_path / tool
        stub.write_text(
            f'#!/bin/bash\necho "{tool} $*" >> {calls}\n'
            # the admin's client config, as the tool sees it
            f'[[ "$*" == *--command-config* ]] && cat "${{@: -1:1}}" > /dev/null; '
            f'for a in "$@"; do [[ -f "$a" && "$a" != */secrets/* ]] && cat "$a" >> {calls}.config; done\n'
            '[[ "$*" == *--describe* ]] && echo "Topic: t PartitionCount: 1 ReplicationFactor: 1"\nexit 0\n',
            encoding="utf-8",
        )
        stub.chmod(0o755)
    env = {
        "PATH": os.environ["PATH"],
        "KAFKA_BIN": str(tmp_path),
        "KAFKA_ADMIN_PASSWORD_FILE": str(secrets / "kafka_admin_password"),
        "SECRETS_DIR": str(secrets),
    }
    subprocess.run(["bash", str(INFRA / "kafka" / "create-topics.sh")], env=env, check=True, capture_output=True,
                   cwd=tmp_path)  # fmt: skip
    lines = calls.read_text(encoding="utf-8").splitlines()
    assert all("--command-config" in line for line in lines), "every call logs in as the admin"
    config = (tmp_path / "calls.config").read_text(encoding="utf-8")
    assert "security.protocol=SASL_PLAINTEXT" in config
    assert 'username="admin" password="pw-admin"' in config
    users = [line for line in lines if "--entity-type users" in line]
    assert [re.search(r"--entity-name (\S+)", u).group(1) for u in users] == list(_script_users())  # type: ignore[union-attr]
    assert not any("pw-" in line for line in lines), "a password on a command line"
    assert all("--add-config-file" in u for u in users)
    for user in _script_users():
        assert f"SCRAM-SHA-512=[password=pw-{user}]" in config  # the users' files, as kafka-configs read them
    acls = [line for line in lines if line.startswith("kafka-acls.sh")]

    def granted(user: str) -> set[str]:
        out = set()
        for line in acls:
            if f"User:{user} " in line:
                op = re.search(r"--operation (\S+)", line).group(1)  # type: ignore[union-attr]
                kind, name = re.search(r"--(topic|group) (\S+)", line).groups()  # type: ignore[union-attr]
                out.add(f"{op}:{kind}:{name}")
        return out

    assert granted("capture") == {"Write:topic:reprolane.envelopes.v1", "Write:topic:reprolane.dead-letter.v1"}
    assert granted("shipper") == {"Write:topic:reprolane.schedules.v1", "Write:topic:reprolane.dead-letter.v1"}
    assert "Write:topic:reprolane.replay-requests.v1" not in set().union(*(granted(u) for u in _script_users()))
    assert "Read:group:reprolane-replayer" in granted("replayer")
    assert "Describe:topic:*" in granted("monitor")  # a literal "*", not a glob of the working directory
    assert not any("Write" in g or "Read" in g for g in granted("monitor"))


# ------------------------------------------------------------------------------------------------ prometheus


def test_prometheus_config_and_rules_pass_promtool() -> None:
    tool = _promtool()
    for args in (["check", "config", "prometheus.yml"], ["check", "rules", "alerts.yml"]):
        done = subprocess.run([tool, *args], cwd=PROMETHEUS, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr


def test_alert_rules_fire_on_bad_series_and_stay_quiet_on_good_ones() -> None:
    done = subprocess.run(
        [_promtool(), "test", "rules", "alerts.test.yml"], cwd=PROMETHEUS, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_rule_file_structure() -> None:
    rules = _rules()
    alerts = {r["alert"]: r for r in rules if "alert" in r}
    assert {
        "ReprolaneDivergenceRateHigh",
        "ReprolaneSpoolNearFull",
        "ReprolaneSpoolFull",
        "ReprolaneSpoolWriteFailing",
        "ReprolanePublishLagHigh",
        "ReprolaneReplayerLag",
        "ReprolaneDeadLettersGrowing",
    } <= set(alerts)
    for rule in rules:
        assert ("alert" in rule) != ("record" in rule), rule
        assert isinstance(rule["expr"], str)
        assert rule["expr"].strip()
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in {"page", "warning"}, name
        assert rule["annotations"]["summary"], name


def test_alerts_reference_only_metrics_and_labels_that_exist() -> None:
    known = _metric_labels()
    recorded = {r["record"] for r in _rules() if "record" in r}
    problems = []
    for rule in _rules():
        where = f"alerts.yml: {rule.get('alert') or rule.get('record')}"
        problems += _check_promql_names(where, rule["expr"], known, recorded)
    assert problems == []


def test_promql_name_check_catches_typos() -> None:
    known = _metric_labels()
    assert _check_promql_names("t", "rate(reprolane_replays_totl[5m])", known, set())
    assert _check_promql_names("t", 'reprolane_capture_spool_depth{sink="kafka"}', known, set())
    assert _check_promql_names("t", "sum by (tenant) (rate(reprolane_capture_requests_total[5m]))", known, set())
    assert not _check_promql_names(
        "t", 'sum by (endpoint) (rate(reprolane_capture_requests_total{status="200"}[5m]))', known, set()
    )


# ------------------------------------------------------------------------------------------------ grafana


def test_grafana_provisioning_points_at_the_dashboards() -> None:
    prov = INFRA / "grafana" / "provisioning"
    ds = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text(encoding="utf-8"))
    uids = {d["uid"] for d in ds["datasources"]}
    assert {d["url"] for d in ds["datasources"]} == {"http://prometheus:9090"}
    providers = yaml.safe_load((prov / "dashboards" / "reprolane.yml").read_text(encoding="utf-8"))["providers"]
    mounts = _services()["grafana"]["volumes"]
    for provider in providers:
        assert f"./infra/grafana/dashboards:{provider['options']['path']}:ro" in mounts
    dashboards = list(_dashboards())
    assert dashboards
    for path, dash in dashboards:
        ids = [p["id"] for p in dash["panels"]]
        assert len(ids) == len(set(ids)), f"{path.name}: duplicate panel ids"
        for panel in dash["panels"]:
            assert {"h", "w", "x", "y"} <= set(panel["gridPos"]), panel["title"]
            if panel["type"] != "row":
                assert panel["datasource"]["uid"] in uids, panel["title"]
                assert panel["targets"], panel["title"]


def test_dashboards_show_what_operators_need() -> None:
    exprs = " ".join(expr for _, expr in _dashboard_exprs())
    for needed in (
        "reprolane_capture_requests_total",  # capture rate
        "reprolane_capture_added_latency_seconds_bucket",  # added latency
        "reprolane_capture_spool_depth",
        "reprolane_capture_publish_lag_seconds",
        "reprolane_replays_total",  # replays and verdict mix
        "reprolane_replay_first_divergence_position_bucket",
        "by (runtime_fingerprint)",
        "by (le, runtime_fingerprint)",
    ):
        assert needed in exprs, needed


def test_dashboard_promql_parses_and_names_existing_metrics(tmp_path: Path) -> None:
    known = _metric_labels()
    recorded = {r["record"] for r in _rules() if "record" in r}
    problems = []
    rules = []
    for i, (where, expr) in enumerate(_dashboard_exprs()):
        promql = _grafana_to_promql(expr)
        problems += _check_promql_names(where, promql, known, recorded)
        rules.append({"record": f"dashboard:expr_{i}", "expr": promql})
    assert problems == []
    (tmp_path / "dashboards.rules.yml").write_text(yaml.safe_dump({"groups": [{"name": "d", "rules": rules}]}))
    done = subprocess.run(
        [_promtool(), "check", "rules", "dashboards.rules.yml"], cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_example_replay_request_keys_are_refused(tmp_path: Path) -> None:
    """A copied replay_request_keys.json.example lets nobody ask for a replay: its one secret is an example value."""
    from replayer.errors import ReplayerError
    from replayer.request_keys import load_replay_request_keys

    copy = tmp_path / "replay_request_keys.json"
    shutil.copy(SECRETS / "replay_request_keys.json.example", copy)
    copy.chmod(0o600)
    with pytest.raises(ReplayerError, match=r"replay_request_keys_path: .*committed example value"):
        load_replay_request_keys(copy)


def test_every_package_in_the_wheel_ships_its_py_typed_marker() -> None:
    """Typed code for type checkers of projects that import reprolane (PEP 561): a marker in each wheel package."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    packages = project["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]
    assert packages
    assert [p for p in packages if not (ROOT / p / "py.typed").is_file()] == []
