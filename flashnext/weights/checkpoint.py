"""Load a Hugging Face checkpoint folder into our canonical state_dict keys (docs/CONTRACTS.md).

Handles single-file and sharded safetensors, the multimodal `model.language_model.` prefix, vision-tower and
MTP tensors (skipped), per-expert or fused (possibly transposed) MoE experts, the PLE n-gram table split into
shards, and GPTQ/AutoRound int4, compressed-tensors int4/int8/fp8 and block-FP8 weights, which are
dequantised on the target device — except the 4-bit weights the caller names in `packed_int4`, which come back
packed in the kernel layout (docs/int4.md).
Everything is planned from the safetensors headers first, so a missing, misshapen or unexpected tensor is
reported before a single byte of weight data is read.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from .checkpoint_keys import canonical_name
from . import compressed_tensors, compressed_tensors_plan
from .fp8 import dequantize_block_fp8
from .int4 import dequantize_gptq
from .int4_layout import SYMMETRIC_ZERO, Int4Weight, dequantize, from_gptq
from .quant_config import QuantizationConfig, read_quantization_config
from .safetensors_dtypes import SAFETENSORS_DTYPES

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
_SKIPPED = (("vision tower", ("model.visual.", "visual.")), ("multi-token-prediction (MTP)", ("mtp.",)))
_EXPERT_KEY = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")
_PER_EXPERT_KEY = re.compile(r"^(.*\.experts)\.(\d+)\.(?:gate_proj|up_proj|down_proj)\.[a-z_]+$")
_NGRAM_KEY = re.compile(r"^(.*\.ngram_embedding)\.weight$")


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded; the message says what is wrong in it."""


def _listing(names: list[str], limit: int = 10) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" ... and {len(names) - limit} more" if len(names) > limit else "")


class _Tensors:
    """The tensors of a checkpoint folder, by canonical name, read lazily through safetensors headers."""

    def __init__(self, folder: Path):
        index = folder / INDEX_FILE
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (folder / f).exists()]
            if missing:
                raise CheckpointError(
                    f"{index} lists {len(missing)} shard file(s) that are not in the folder: {_listing(missing)}"
                )
        elif (folder / "model.safetensors").exists():
            files = ["model.safetensors"]
        else:
            raise CheckpointError(f"no model.safetensors or {INDEX_FILE} in {folder}")
        self.handles = {}
        self.where: dict[str, tuple[str, str]] = {}
        skipped = {group: 0 for group, _ in _SKIPPED}
        for file in files:
            try:
                handle = safe_open(str(folder / file), framework="pt", device="cpu")
            except Exception as error:  # safetensors raises its own untyped errors for bad headers
                raise CheckpointError(f"{folder / file} is not a readable safetensors file "
                                      f"(truncated or corrupt?): {error}") from error
            self.handles[file] = handle
            for key in handle.keys():
                group = next((g for g, prefixes in _SKIPPED if key.startswith(prefixes)), None)
                if group is not None:
                    skipped[group] += 1
                    continue
                name = canonical_name(key)
                if name in self.where:
                    raise CheckpointError(f"tensor {name} appears twice in the checkpoint "
                                          f"({self.where[name][0]} and {file})")
                self.where[name] = (file, key)
        for group, count in skipped.items():
            if count:
                log.info("skipping %d %s tensors (not used for text generation)", count, group)
        self.used: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self.where

    def _slice(self, name: str):
        file, key = self.where[name]
        return self.handles[file].get_slice(key)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype | None:
        return SAFETENSORS_DTYPES.get(self._slice(name).get_dtype())

    def nbytes(self, name: str) -> int:
        piece = self._slice(name)
        dtype = SAFETENSORS_DTYPES.get(piece.get_dtype())
        return math.prod(piece.get_shape()) * (dtype.itemsize if dtype is not None else 4)

    def use(self, name: str) -> str:
        self.used.add(name)
        return name

    def read(self, name: str, device: torch.device) -> torch.Tensor:
        file, key = self.where[name]
        return self.handles[file].get_tensor(key).to(device)

    def read_rows(self, name: str, first: int, count: int, device: torch.device) -> torch.Tensor:
        """Rows first … first + count - 1 of a tensor; only those are read from the file."""
        return self._slice(name)[first: first + count].to(device)

    def skip(self, belongs) -> None:
        """Count the tensors for whose name belongs(name) holds as used without reading them (another rank's
        experts), so that they are not reported as unexpected."""
        self.used.update(n for n in self.where if belongs(n))


@dataclass
class _Recipe:
    """How to build one expected tensor: the canonical source tensors it reads, and the builder."""

    sources: list[str]
    build: Callable[[], torch.Tensor]


class _Planner:
    def __init__(self, tensors: _Tensors, quant: QuantizationConfig, config: dict, device, dtype,
                 packed_int4: frozenset[str] = frozenset(), expert_share: tuple[int, int] | None = None,
                 into: dict[str, torch.Tensor] | None = None):
        self.t, self.quant, self.config, self.device, self.dtype = tensors, quant, config, device, dtype
        self.packed_int4 = packed_int4
        self.into = into or {}   # name → the tensor to fill instead of a new one (a table shared by ranks)
        # (first, total): stacked experts [E, ...] hold experts first … first + E - 1 of the checkpoint's total
        self.expert_share = expert_share

    # A 2-D weight `X.weight` stored plain, as int4 (`X.qweight` ...) or as fp8 (+ `X.weight_scale_inv`).
    def weight(self, name: str, shape: tuple[int, ...], packed: bool | None = None) -> _Recipe | None:
        """packed: keep a 4-bit GPTQ or compressed-tensors tensor as an Int4Weight (default: when `name` is in
        packed_int4)."""
        base = name[: -len(".weight")] if name.endswith(".weight") else None
        t = self.t
        if base is not None and t.has(base + ".qweight"):
            parts = [base + s for s in (".qweight", ".qzeros", ".scales", ".g_idx") if t.has(base + s)]
            if len(parts) < 3:
                raise CheckpointError(f"int4 tensor {base}.qweight comes without its qzeros/scales")
            rows, cols = t.shape(base + ".qweight")
            # The bit width follows from the packed rows and the expected input size (AutoRound may keep
            # some layers at 8 bits); anything else is a shape mismatch.
            bits = 32 * rows // shape[-1] if len(shape) == 2 and shape[-1] else 0
            if len(shape) != 2 or cols != shape[0] or bits not in (2, 4, 8) or rows * 32 != bits * shape[-1]:
                got = (cols, rows * 32 // (self.quant.bits if self.quant.bits < 16 else 4))
                raise CheckpointError(f"tensor {base} (int4) has the wrong shape: expected {shape}, got {got}")

            keep_packed = (name in self.packed_int4 if packed is None else packed) and bits == 4

            def build() -> torch.Tensor | Int4Weight:
                packed = {s.rsplit(".", 1)[1]: t.read(s, self.device) for s in parts}
                if keep_packed:
                    try:
                        return from_gptq(packed["qweight"], packed["qzeros"], packed["scales"], packed.get("g_idx"),
                                         sym=self.quant.symmetric(base), zeros_minus_one=self.quant.zeros_minus_one)
                    except ValueError as e:
                        raise CheckpointError(f"int4 tensor {base}: {e}") from None
                return dequantize_gptq(packed["qweight"], packed["qzeros"], packed["scales"], packed.get("g_idx"),
                                       bits=bits, zeros_minus_one=self.quant.zeros_minus_one)

            return _Recipe([t.use(p) for p in parts], build)
        if base is not None and t.has(f"{base}.{compressed_tensors.PACKED}"):
            keep_packed = name in self.packed_int4 if packed is None else packed
            return self._compressed_tensors(compressed_tensors_plan.plan_packed, base, shape, keep_packed)
        if not t.has(name):
            return None
        self._check_shape(name, t.shape(name), shape)
        if (self.quant.method == "compressed-tensors" and base is not None
                and t.has(f"{base}.{compressed_tensors.SCALE}")):
            return self._compressed_tensors(compressed_tensors_plan.plan_unpacked, name, base, self.quant.weight_block)
        scale = name + "_scale_inv"
        if t.has(scale):
            block = self.quant.fp8_block
            return _Recipe([t.use(name), t.use(scale)],
                           lambda: dequantize_block_fp8(t.read(name, self.device), t.read(scale, self.device), block))
        return _Recipe([t.use(name)], lambda: t.read(name, self.device))

    def _compressed_tensors(self, plan, *args) -> _Recipe:
        """A compressed-tensors weight through `plan` (weights/compressed_tensors_plan.py), its problems reported as
        CheckpointError, at planning or at reading."""
        try:
            sources, build = plan(self.t, *args, self.device)
        except ValueError as e:
            raise CheckpointError(str(e)) from None

        def checked() -> torch.Tensor | Int4Weight:
            try:
                return build()
            except ValueError as e:
                raise CheckpointError(f"compressed-tensors weight {args[0]}: {e}") from None

        return _Recipe(sources, checked)

    @staticmethod
    def _check_shape(name: str, got: tuple[int, ...], expected: tuple[int, ...]) -> None:
        if tuple(got) != tuple(expected):
            raise CheckpointError(f"tensor {name} has the wrong shape: expected {tuple(expected)}, got {tuple(got)}")

    def _stacked(self, shape: tuple[int, ...], pieces: list[list[_Recipe]], split: list[int]) -> _Recipe:
        """Stack per-expert weights: out[e] = cat(pieces[e], dim 0), each piece `split[j]` rows."""

        def build() -> torch.Tensor:
            out = torch.empty(shape, dtype=self.dtype, device=self.device)
            for e, recipes in enumerate(pieces):
                row = 0
                for recipe, rows in zip(recipes, split):
                    piece = recipe.build()
                    out[e, row: row + rows].copy_(dequantize(piece) if isinstance(piece, Int4Weight) else piece)
                    row += rows
            return out

        return _Recipe([s for recipes in pieces for r in recipes for s in r.sources], build)

    def experts(self, name: str, shape: tuple[int, ...]) -> _Recipe | None:
        prefix, kind = _EXPERT_KEY.match(name).groups()
        t = self.t
        if t.has(name):
            got = t.shape(name)
            first, total = self.expert_share or (0, shape[0])
            # Qwen3-VL-MoE-style checkpoints store the fused experts as [E, in, out]; transpose when the shape
            # can only mean that (transformers' Transpose(check_dims=True)).
            if got[1:] != tuple(shape[1:]) and got[1:] == (shape[2], shape[1]):
                self._check_shape(name, (got[0], got[2], got[1]), (total, *shape[1:]))
                return _Recipe([t.use(name)], lambda: t.read_rows(name, first, shape[0], self.device)
                               .transpose(1, 2).contiguous())
            self._check_shape(name, got, (total, *shape[1:]))
            return _Recipe([t.use(name)], lambda: t.read_rows(name, first, shape[0], self.device))
        num_experts, rows, cols = shape
        projections = ["gate_proj", "up_proj"] if kind == "gate_up_proj" else ["down_proj"]
        split = [rows // len(projections)] * len(projections)
        stored = [f"{prefix}.0.{projections[0]}.{suffix}"
                  for suffix in ("weight", "qweight", compressed_tensors.PACKED)]
        if not any(t.has(n) for n in stored):
            return None
        packed = name in self.packed_int4 and any(t.has(n) for n in stored[1:])
        pieces, missing = [], []
        first = self.expert_share[0] if self.expert_share else 0
        for e in range(first, first + num_experts):
            recipes = []
            for proj, piece_rows in zip(projections, split):
                piece = f"{prefix}.{e}.{proj}.weight"
                recipe = self.weight(piece, (piece_rows, cols), packed=packed)
                if recipe is None:
                    missing.append(piece)
                recipes.append(recipe)
            pieces.append(recipes)
        if missing:
            raise CheckpointError(f"checkpoint is missing {len(missing)} expert tensor(s): {_listing(missing)}")
        return self._stacked_int4(shape, pieces, split) if packed else self._stacked(shape, pieces, split)

    def _stacked_int4(self, shape: tuple[int, ...], pieces: list[list[_Recipe]], split: list[int]) -> _Recipe:
        """Per-expert 4-bit pieces (GPTQ or compressed-tensors) → one stacked Int4Weight (qweight [E, K/8, N], gate
        rows then up rows, as Int4Experts takes it), never dequantised. Act-order pieces (their own row permutations),
        pieces of other bit widths or group sizes fall back to the dequantised stack."""

        def build() -> torch.Tensor | Int4Weight:
            built, weights = [], []
            for recipes in pieces:   # built one expert at a time: the fallback at the first that does not fit
                parts = [r.build() for r in recipes]
                if not all(isinstance(w, Int4Weight) and w.perm is None
                           and w.group_size == (weights or parts)[0].group_size for w in parts):
                    return self._stacked(shape, pieces, split).build()
                built.append(parts)
                weights += parts
            # an asymmetric checkpoint where some pieces read as symmetric (all their zero points 8, so from_rows
            # drops them): those get 8s when any piece of the layer has zero points
            zeros = next((w.zeros for w in weights if w.zeros is not None), None)

            def zeros_of(w: Int4Weight) -> torch.Tensor:
                return w.zeros if w.zeros is not None else torch.full(w.scales.shape, SYMMETRIC_ZERO, dtype=zeros.dtype,
                                                                      device=zeros.device)

            cat = lambda parts, get: torch.cat([get(w) for w in parts], dim=1)  # noqa: E731
            stack = lambda get: torch.stack([cat(parts, get) for parts in built])  # noqa: E731
            return Int4Weight(stack(lambda w: w.qweight), stack(lambda w: w.scales),
                              None if zeros is None else stack(zeros_of), None, weights[0].group_size)

        return _Recipe([s for recipes in pieces for r in recipes for s in r.sources], build)

    def ngram_table(self, name: str, shape: tuple[int, ...]) -> _Recipe | None:
        direct = self.weight(name, shape)
        if direct is not None:
            return direct
        prefix = _NGRAM_KEY.match(name).group(1)
        count = 0
        while self.t.has(f"{prefix}.shard_{count}.weight"):
            count += 1
        if count == 0:
            return None
        text = self.config.get("text_config", self.config)
        declared = text.get("split_ngram_parts")
        if declared is not None and declared != count:
            raise CheckpointError(f"config.json declares split_ngram_parts={declared} but the checkpoint has "
                                  f"{count} shards of {prefix}")
        rows = [self.t.shape(f"{prefix}.shard_{i}.weight")[0] for i in range(count)]
        if sum(rows) != shape[0]:
            raise CheckpointError(f"tensor {name} has the wrong shape: expected {tuple(shape)}, got "
                                  f"{(sum(rows), *self.t.shape(f'{prefix}.shard_0.weight')[1:])} from {count} shards")
        shards = [self.weight(f"{prefix}.shard_{i}.weight", (r, shape[1])) for i, r in enumerate(rows)]

        def build() -> torch.Tensor:
            # Filled shard by shard: the real table is ~100 GB, too big for a temporary concatenation.
            out = self.into.get(name)
            if out is None:
                out = torch.empty(shape, dtype=self.dtype, device=self.device)
            start = 0
            for shard, r in zip(shards, rows):
                out[start: start + r].copy_(shard.build())
                start += r
            return out

        return _Recipe([s for shard in shards for s in shard.sources], build)

    def plan(self, name: str, shape: tuple[int, ...]) -> _Recipe | None:
        if _EXPERT_KEY.match(name):
            return self.experts(name, shape)
        if _NGRAM_KEY.match(name):
            return self.ngram_table(name, shape)
        return self.weight(name, shape)


def load_checkpoint(
    path: str | Path,
    expected: dict[str, tuple[tuple[int, ...], torch.dtype]],
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    progress: bool = True,
    packed_int4: frozenset[str] = frozenset(),
    host_names: frozenset[str] = frozenset(),
    expert_range: tuple[int, int] | None = None,
    into: dict[str, torch.Tensor] | None = None,
    not_read: frozenset[str] = frozenset(),
) -> dict[str, torch.Tensor | Int4Weight]:
    """Read the checkpoint folder `path` into tensors keyed and shaped like `expected` ({name: (shape, dtype)}).

    Floating tensors come back in `dtype` (quantised ones dequantised), integer buffers in their expected dtype,
    all on `device`. Names in `packed_int4` that the checkpoint stores as 4-bit GPTQ or compressed-tensors integers
    come back as Int4Weight (the kernel layout; scales keep the checkpoint's dtype) instead. Names in `host_names` are read into CPU
    memory whatever `device` is (routed experts that an expert cache keeps in host RAM). `expert_range`
    (first, count): of every routed expert set only these experts are read, stacked [count, ...] (expert
    parallel: one rank's share, so no rank ever holds the others'). `into` {name: tensor}: fill these tensors
    (in `dtype`, where they are) and return them, e.g. a table in memory that several ranks share; `not_read`:
    names checked and counted as used but not read nor returned (a rank that maps another rank's copy).
    Raises CheckpointError naming the problem for missing, unexpected or misshapen tensors, unreadable files
    and missing shards.
    """
    folder = Path(path)
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text()) if config_file.exists() else {}
    device = torch.device(device)
    tensors = _Tensors(folder)
    quant = read_quantization_config(config)
    if quant.activations_quantised:
        log.info("%s quantises activations too (compressed-tensors W8A8 / W4A8); flashnext computes them in 16 bits "
                 "from the dequantised weights", folder)
    share = None
    if expert_range is not None:
        first, count = expert_range
        totals = {shape[0] for name, (shape, _) in expected.items() if _EXPERT_KEY.match(name)}
        if len(totals) > 1 or not all(0 <= first < first + count <= total for total in totals):
            raise ValueError(f"expert range {expert_range} does not fit the model's experts {sorted(totals)}")
        share = (first, totals.pop()) if totals else None
        expected = {name: ((count, *shape[1:]) if _EXPERT_KEY.match(name) else shape, dt)
                    for name, (shape, dt) in expected.items()}
    planners = {on_host: _Planner(tensors, quant, config, torch.device("cpu") if on_host else device, dtype,
                                  packed_int4, share, into)
                for on_host in (False, True)}
    recipes, missing, aliases = {}, [], {}
    text = config.get("text_config", config)
    tied = bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
    for name, (shape, _) in expected.items():
        recipe = planners[name in host_names].plan(name, tuple(shape))
        if recipe is None and tied and name == "lm_head.weight":   # save_pretrained writes a tied head not at all
            embed = "model.embed_tokens.weight"
            # the embedding's tensor itself (read once) where both are expected alike and in one place
            if (expected.get(embed) == expected[name] and (embed in host_names) == (name in host_names)
                    and (embed in not_read) == (name in not_read)):
                aliases[name] = embed
                continue
            recipe = planners[name in host_names].plan(embed, tuple(shape))
        if recipe is None:
            missing.append(name)
        else:
            recipes[name] = recipe
    if missing:
        raise CheckpointError(f"checkpoint {folder} is missing {len(missing)} tensor(s): {_listing(missing)}")
    if share is not None:   # the other ranks' per-expert tensors: not read here, and not unexpected (one pass)
        sets = {m.group(1) for name in expected if (m := _EXPERT_KEY.match(name))}
        tensors.skip(lambda n: (m := _PER_EXPERT_KEY.match(n)) is not None and m.group(1) in sets
                     and int(m.group(2)) < share[1])
    unexpected = sorted(set(tensors.where) - tensors.used)
    if unexpected:
        raise CheckpointError(f"checkpoint {folder} has {len(unexpected)} tensor(s) this model does not use: "
                              f"{_listing(unexpected)}")
    total = sum(tensors.nbytes(s) for name, recipe in recipes.items() if name not in not_read for s in recipe.sources)
    result = {}
    with tqdm(total=total, unit="B", unit_scale=True, desc="Loading weights", disable=not progress) as bar:
        for name, recipe in recipes.items():
            if name in not_read:
                continue
            shape, expected_dtype = expected[name]
            out_dtype = dtype if expected_dtype.is_floating_point else expected_dtype
            built = recipe.build()
            if isinstance(built, Int4Weight):
                lead = tuple(built.qweight.shape[:-2])     # the expert dimension of stacked experts
                assert (*lead, built.out_features, built.in_features) == tuple(shape), (name, built.qweight.shape, shape)
                result[name] = built
            else:
                tensor = built.to(out_dtype)
                assert tuple(tensor.shape) == tuple(shape), (name, tensor.shape, shape)
                if into and name in into and tensor is not into[name]:   # a table stored whole, not in shards
                    tensor = into[name].copy_(tensor)
                result[name] = tensor
            bar.update(sum(tensors.nbytes(s) for s in recipe.sources))
    result.update({name: result[embed] for name, embed in aliases.items() if name not in not_read})
    return result
