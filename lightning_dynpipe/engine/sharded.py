"""Sharded, partition-independent checkpoints through ``torch.distributed.checkpoint`` (DCP).

Each stage writes only its own layers and their optimizer state; nothing is gathered. The checkpoint is a DCP
directory whose entries use the plain module's keys and the plain optimizer's canonical indices, so it loads
under any partition, number of stages or data-parallel width, and into a plain model in one process:

* ``state_dict.<key>``: one tensor per key of the plain module's ``state_dict`` (a parameter shared by several
  layers is stored once, under its first key; the checkpoint's metadata names its other keys),
* ``optimizer_states.<o>.state.<c>.<name>``: entry ``name`` of the state of canonical parameter ``c`` of
  optimizer ``o`` (a parameter whose state is an empty dict has the single entry ``optimizer_states.<o>.state.<c>``),
* ``checkpoint``: everything else Lightning's checkpoint holds (loops, callbacks, schedulers, the optimizers'
  ``param_groups``, ``dynpipe`` metadata), written by one rank.

A stage loading it reads only the entries it owns (tensor shapes from DCP's metadata), straight into its live
tensors. The two standard lines that load the weights into a plain model, in one process::

    import torch.distributed.checkpoint as dcp
    dcp.load({"state_dict": model.state_dict()}, checkpoint_id="checkpoints/last.ckpt")

and :func:`consolidate` turns the directory into the full checkpoint (as ``checkpoint="full"`` writes it).

Pure torch: no Lightning.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from lightning_dynpipe.engine.ties import SharedParameter
from lightning_dynpipe.errors import ConfigurationError

__all__ = [
    "MODEL",
    "OPTIMIZER",
    "REST",
    "tie_aliases",
    "local_model_entries",
    "local_optimizer_entries",
    "save",
    "is_sharded_checkpoint",
    "read_metadata",
    "load_stage",
    "consolidate",
]

MODEL = "state_dict."
"""The prefix of the model's entries."""
OPTIMIZER = "optimizer_states."
"""The prefix of the optimizers' per-parameter entries."""
REST = "checkpoint"
"""The entry holding everything else of the Lightning checkpoint."""


def tie_aliases(ties: Sequence[SharedParameter], prefix: str) -> dict[str, str]:
    """``{other key: first key}`` of every shared parameter, in the plain module's key space."""
    out: dict[str, str] = {}
    for tie in ties:
        keys = [f"{prefix}{i}.{n}" for i, n in tie.occurrences]
        for k in keys[1:]:
            out[k] = keys[0]
    return out


def local_model_entries(
    module_state: Mapping[str, Any],
    prefix: str,
    owned: Collection[int],
    aliases: Mapping[str, str],
    outside: bool,
) -> dict[str, Any]:
    """The model entries this stage writes: its layers' keys (a shared parameter only under its first key, so by
    the stage that owns the first layer using it), and with ``outside`` the entries outside the pipeline.

    Args:
        module_state: the LightningModule's ``state_dict`` on this stage (its own layers only).
        prefix: the pipeline's key prefix, e.g. ``"pipeline."``.
        owned: the layers this stage owns.
        aliases: :func:`tie_aliases`.
        outside: whether this stage writes the entries outside the pipeline (one stage of one pipeline does).
    """
    mine = tuple(f"{prefix}{i}." for i in owned)
    out: dict[str, Any] = {}
    for k, v in module_state.items():
        if k in aliases:
            continue
        if k.startswith(prefix) and not k.startswith(mine):
            continue
        if not k.startswith(prefix) and not outside:
            continue
        out[MODEL + k] = v
    return out


def local_optimizer_entries(opt_idx: int, shard: Mapping[str, Any]) -> dict[str, Any]:
    """The optimizer entries of this stage's part of the plain optimizer's ``state_dict``.

    Args:
        opt_idx: the optimizer's index in Lightning's list.
        shard: ``{"state": {canonical index: state}}`` of the parameters this stage writes (each parameter is
            written by one stage: :meth:`~lightning_dynpipe.engine.stage.PipelineStage.optimizer_shard`).
    """
    out: dict[str, Any] = {}
    for c, st in shard.get("state", {}).items():
        if not st:
            out[f"{OPTIMIZER}{opt_idx}.state.{c}"] = {}
        for name, value in st.items():
            out[f"{OPTIMIZER}{opt_idx}.state.{c}.{name}"] = value
    return out


def save(entries: dict[str, Any], path: str | os.PathLike[str], process_group: Any = None) -> None:
    """Writes this rank's ``entries`` into the DCP directory ``path``. Collective over ``process_group``
    (default: WORLD): every rank calls it, with its own entries (``{}`` is fine)."""
    dcp_save(
        entries,
        storage_writer=FileSystemWriter(os.fspath(path), single_file_per_rank=True, thread_count=1),
        planner=DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False),  # REST: one object
        process_group=process_group,
    )


def is_sharded_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a DCP checkpoint directory (rather than a ``torch.save`` file)."""
    return Path(path).is_dir() and (Path(path) / ".metadata").is_file()


def read_metadata(path: str | os.PathLike[str]) -> Metadata:
    """DCP's metadata of the checkpoint at ``path``: every entry's name and, for tensors, shape and dtype."""
    return FileSystemReader(os.fspath(path)).read_metadata()


def _parse_optimizer_key(fqn: str) -> tuple[int, int, str | None]:
    """``optimizer_states.<o>.state.<c>[.<name>]`` -> ``(o, c, name)``."""
    o, kind, rest = fqn[len(OPTIMIZER) :].split(".", 2)
    if kind != "state":
        raise ConfigurationError(f"Unknown entry {fqn!r} in a sharded checkpoint (expected {OPTIMIZER}<o>.state...).")
    c, _, name = rest.partition(".")
    return int(o), int(c), name or None


def _empty(meta: Any) -> Any:
    if isinstance(meta, TensorStorageMetadata):
        return torch.empty(meta.size, dtype=meta.properties.dtype)
    assert isinstance(meta, BytesStorageMetadata)
    return None


def _read(path: str | os.PathLike[str], template: dict[str, Any]) -> dict[str, Any]:
    """Fills ``template`` (entries by name: the tensors to read into, ``None`` for other objects), one process."""
    if template:
        dcp_load(
            template,
            storage_reader=FileSystemReader(os.fspath(path)),
            planner=DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
            no_dist=True,
        )
    return template


def load_stage(
    path: str | os.PathLike[str],
    *,
    targets: Mapping[str, Tensor],
    prefix: str,
    aliases: Mapping[str, str],
    expected_keys: Sequence[str],
    wanted: Sequence[Collection[int]],
) -> dict[str, Any]:
    """Reads what one stage needs from a sharded checkpoint: a Lightning checkpoint with its part only.

    No process group is needed: each rank reads its own entries. The model's entries are read straight into
    ``targets`` (the stage's live tensors); the optimizer state of the canonical parameters ``wanted`` into new
    CPU tensors (``optimizer.load_state_dict`` moves them where the parameters are).

    Args:
        path: the DCP directory.
        targets: this stage's module ``state_dict`` (own layers and the entries outside the pipeline).
        prefix: the pipeline's key prefix.
        aliases: :func:`tie_aliases` of the model being loaded.
        expected_keys: every key of the whole plain module's ``state_dict``.
        wanted: per optimizer, the canonical indices whose state this stage loads.

    Returns:
        The checkpoint dict, with ``state_dict`` holding ``targets``' keys (filled) and each
        ``optimizer_states[o]["state"]`` the ``wanted`` parameters' state.

    Raises:
        ConfigurationError: the checkpoint's model keys are not the module's (the rule of a strict
            ``load_state_dict``), or its tensors have other shapes.
    """
    md = read_metadata(path).state_dict_metadata
    saved_keys = {fqn[len(MODEL) :] for fqn in md if fqn.startswith(MODEL)}
    want_keys = {k for k in expected_keys if k not in aliases}
    if saved_keys != want_keys:
        missing, unexpected = sorted(want_keys - saved_keys), sorted(saved_keys - want_keys)
        raise ConfigurationError(
            f"The sharded checkpoint {os.fspath(path)!r} does not hold this model's weights: missing keys "
            f"{missing[:5]}{' ...' if len(missing) > 5 else ''}, unexpected keys {unexpected[:5]}"
            f"{' ...' if len(unexpected) > 5 else ''}. Load it into the model that wrote it."
        )
    template: dict[str, Any] = {REST: None}
    for key, t in targets.items():
        fqn = MODEL + aliases.get(key, key)
        if fqn in template:
            continue  # a shared parameter this stage holds under two keys: one tensor
        meta = md[fqn]
        if isinstance(meta, TensorStorageMetadata) and isinstance(t, Tensor) and tuple(meta.size) != tuple(t.shape):
            raise ConfigurationError(
                f"{key!r} has shape {tuple(meta.size)} in the checkpoint {os.fspath(path)!r} but {tuple(t.shape)} in "
                "the model. Load it into the model that wrote it."
            )
        template[fqn] = t if isinstance(meta, TensorStorageMetadata) else None
    wanted_sets = [set(w) for w in wanted]
    for fqn, meta in md.items():
        if fqn.startswith(OPTIMIZER):
            o, c, _ = _parse_optimizer_key(fqn)
            if o < len(wanted_sets) and c in wanted_sets[o]:
                template[fqn] = _empty(meta)
    _read(path, template)
    out = dict(template.pop(REST))
    out["state_dict"] = {key: template[MODEL + aliases.get(key, key)] for key in targets}
    _put_optimizer_states(out, template)
    return out


def _put_optimizer_states(out: dict[str, Any], entries: Mapping[str, Any]) -> None:
    """Puts the ``optimizer_states.*`` entries into ``out["optimizer_states"][o]["state"]``, in canonical order."""
    states: dict[int, dict[int, dict[str, Any]]] = {}
    for fqn, value in entries.items():
        if not fqn.startswith(OPTIMIZER):
            continue
        o, c, name = _parse_optimizer_key(fqn)
        st = states.setdefault(o, {}).setdefault(c, {})
        if name is not None:
            st[sys.intern(name)] = value  # shared key objects, as in the optimizer
    for o, opt in enumerate(out.get("optimizer_states", [])):
        per = states.get(o, {})
        out["optimizer_states"][o] = {"state": {c: per[c] for c in sorted(per)}, **opt}


def consolidate(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The full checkpoint (what ``checkpoint="full"`` writes) from a sharded one, in this one process.

    It holds the whole model and optimizer state in memory: for a model that fits one process. Save it with
    ``torch.save`` to get a file that a plain ``Trainer`` or ``LightningModule.load_from_checkpoint`` reads.
    """
    md = read_metadata(path).state_dict_metadata
    template = {fqn: _empty(meta) for fqn, meta in md.items()}
    _read(path, template)
    out = dict(template.pop(REST))
    meta = out.get("dynpipe", {})
    aliases: dict[str, str] = meta.get("aliases", {})
    order: list[str] = meta.get("key_order") or [fqn[len(MODEL) :] for fqn in template if fqn.startswith(MODEL)]
    out["state_dict"] = {k: template[MODEL + aliases.get(k, k)] for k in order}
    _put_optimizer_states(out, template)
    return out
