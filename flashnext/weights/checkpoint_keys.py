"""Checkpoint tensor names → our canonical names (docs/CONTRACTS.md), shared by the loader and the quantization
config (whose per-module overrides a multimodal checkpoint names with its own prefix)."""

_MULTIMODAL_TEXT_PREFIX = "model.language_model."


def canonical_name(checkpoint_key: str) -> str:
    """Checkpoint key -> our key: multimodal releases nest the text model under `model.language_model.`."""
    if checkpoint_key.startswith(_MULTIMODAL_TEXT_PREFIX):
        return "model." + checkpoint_key[len(_MULTIMODAL_TEXT_PREFIX):]
    return checkpoint_key
