"""Find a model folder: a local path as is, otherwise a Hugging Face Hub id downloaded into the HF cache."""

from __future__ import annotations

from pathlib import Path

# Everything serving needs: weights, configs, tokenizer, chat template. Not *.bin/*.pt/*.gguf/images.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]


def resolve_model_path(name_or_path: str | Path, *, revision: str | None = None) -> Path:
    """Return the folder of `name_or_path`: an existing local folder, or a snapshot of that hub repository."""
    local = Path(name_or_path).expanduser()
    if local.is_dir():
        return local
    if local.exists():
        raise ValueError(f"{local} is a file; pass the model folder that contains config.json")
    name = str(name_or_path)
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise FileNotFoundError(f"model folder {name} does not exist")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(name, revision=revision, allow_patterns=ALLOW_PATTERNS))
    except LocalEntryNotFoundError as error:
        raise FileNotFoundError(
            f"{name} is neither a local folder nor in the Hugging Face cache, and it could not be downloaded "
            "(offline, HF_HUB_OFFLINE=1, or no network). Download it first or pass a local folder."
        ) from error
    except RepositoryNotFoundError as error:
        raise FileNotFoundError(f"{name} is neither a local folder nor a model on the Hugging Face Hub "
                                "(or it is private: log in with `hf auth login`)") from error
    except HfHubHTTPError as error:
        raise FileNotFoundError(f"downloading {name} from the Hugging Face Hub failed: {error}") from error
