"""The model manifest's one decoder (infra writes it, infra and the sidecar read it) and the runtime file's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from schemas.errors import ContractError
from schemas.manifest import MANIFEST_VERSION, decode_manifest, decode_runtime_file
from tests.factories import manifest_doc


def test_a_manifest_round_trips_through_its_file_text() -> None:
    manifest = decode_manifest(json.dumps(manifest_doc(generation_defaults={"temperature": 0.6, "top_k": 20})))
    assert manifest.manifest_version == MANIFEST_VERSION
    assert manifest.generation_defaults == {"temperature": 0.6, "top_k": 20}
    assert isinstance(manifest.generation_defaults["top_k"], int)
    assert manifest.weight_files == ("model.safetensors",)
    assert manifest.knows_generation_defaults
    text = manifest.encode()
    assert text.endswith("}\n")
    assert "path" not in json.loads(text)
    assert decode_manifest(text) == manifest
    located = decode_manifest(text, Path("/models/m"))
    assert located.path == Path("/models/m")
    assert located.model_dump() == manifest.model_dump()  # path is not part of the file


def test_an_older_manifest_decodes_and_says_it_knows_no_defaults() -> None:
    doc = manifest_doc(manifest_version=2)
    del doc["generation_defaults"]
    manifest = decode_manifest(json.dumps(doc))
    assert manifest.generation_defaults == {}
    assert not manifest.knows_generation_defaults


@pytest.mark.parametrize(
    ("data", "named"),
    [
        ("not json", "invalid manifest"),
        ("[1, 2]", "invalid manifest"),
        (json.dumps({"model_name": "x"}), "model_sha256"),
        (json.dumps(manifest_doc(model_sha256="A" * 64)), "model_sha256"),  # lowercase hex only
        (json.dumps(manifest_doc(chat_template_sha256="c" * 63)), "chat_template_sha256"),
        (json.dumps(manifest_doc(extra_field=1)), "extra_field"),
        (json.dumps(manifest_doc(generation_defaults={"temperature": "0.6"})), "generation_defaults.temperature"),
        (json.dumps(manifest_doc(generation_defaults={"top_k": True})), "generation_defaults.top_k"),
    ],
)
def test_a_bad_manifest_names_what_is_wrong(data: str, named: str) -> None:
    with pytest.raises(ContractError, match=named):
        decode_manifest(data)


def test_the_runtime_file_is_validated_field_by_field() -> None:
    assert decode_runtime_file(b'{"dtype": "bfloat16", "tensor_parallel_size": 2}') == {
        "dtype": "bfloat16",
        "tensor_parallel_size": 2,
    }
    with pytest.raises(ContractError, match="invalid field") as caught:
        decode_runtime_file(b'{"dtyp": "bfloat16", "tensor_parallel_size": "two"}')
    assert set(caught.value.fields) == {"dtyp", "tensor_parallel_size"}
    with pytest.raises(ContractError, match="not JSON"):
        decode_runtime_file(b"{")
    with pytest.raises(ContractError, match="JSON object"):
        decode_runtime_file(b"[]")
