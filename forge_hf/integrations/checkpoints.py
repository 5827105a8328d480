"""Which Trainer checkpoints can be resumed, checked without loading them.

The Trainer writes a checkpoint-N's trainer_state.json last, after the model, the
optimizer, the scheduler and the RNG states (ForgeTrainer also waits for every process's
files first, and removes a stale one before writing the checkpoint again). So a save cut
short leaves a checkpoint-N without trainer_state.json, or with it cut short: an
*unfinished* save, which ``resume_from_checkpoint=True`` skips, saying so.

A *finished* one is resumed only if it also holds, each whole,
- the model's weights: model.safetensors or pytorch_model.bin (or their index and every
  shard it names), a PEFT adapter's (or several, one folder each), or FSDP's (pytorch_model_fsdp.bin or
  pytorch_model_fsdp_0/);
- unless it was saved with save_only_model (then none of them): the optimizer
  (optimizer.pt, or forge_optimizer/ under FSDP2's sharded state dict), scheduler.pt and
  the RNG states (rng_state.pth, or rng_state_<process>.pth).
Whole means: a torch.save archive has its zip directory (written at its end), a
safetensors file is as long as its header says, a distributed checkpoint has its
.metadata (written once every shard is). A missing or damaged file is refused in one
line naming it, rather than surfacing as torch.load's traceback.
"""

import json
import os
import re
import struct
import sys
import zipfile

from transformers.trainer import FSDP_MODEL_NAME, OPTIMIZER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import (
    ADAPTER_SAFE_WEIGHTS_NAME,
    ADAPTER_WEIGHTS_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    logging,
)

logger = logging.get_logger(__name__)

FORGE_SHARDED_OPTIMIZER = "forge_optimizer"  # ForgeTrainer's optimizer states under FSDP2's sharded state dict
_STEP = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
_WEIGHTS = (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME, ADAPTER_SAFE_WEIGHTS_NAME,
            ADAPTER_WEIGHTS_NAME, f"{FSDP_MODEL_NAME}.bin", f"{FSDP_MODEL_NAME}_0")


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed; the message names the file and the fix."""


def unfinished(checkpoint: str) -> str | None:
    """Why ``checkpoint``'s save did not finish, or None if it did."""
    state = os.path.join(checkpoint, TRAINER_STATE_NAME)
    if not os.path.isfile(state):
        return f"an unfinished save (no {TRAINER_STATE_NAME}, which the Trainer writes last)"
    try:
        with open(state, encoding="utf-8") as f:
            json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        return f"an unfinished save ({state} is cut short or damaged: {e})"
    return None


def damage(checkpoint: str) -> tuple[str, str] | None:
    """(the file, what is wrong with it) for the first missing or damaged file of a finished
    save, or None if every file is whole."""
    present = set(os.listdir(checkpoint))
    weights = [name for name in _WEIGHTS if name in present] or [  # several PEFT adapters: one folder each
        os.path.join(n, a) for n in sorted(present) for a in (ADAPTER_SAFE_WEIGHTS_NAME, ADAPTER_WEIGHTS_NAME)
        if os.path.isfile(os.path.join(checkpoint, n, a))]
    if not weights:
        return os.path.join(checkpoint, SAFE_WEIGHTS_NAME), f"missing (nor any of {', '.join(_WEIGHTS[1:])})"
    files = [os.path.join(checkpoint, name) for name in weights]
    optimizer = [n for n in (OPTIMIZER_NAME, FORGE_SHARDED_OPTIMIZER) if n in present]
    rng = sorted(n for n in present if re.fullmatch(r"rng_state(_\d+)?\.pth", n))
    if optimizer or SCHEDULER_NAME in present or rng:  # not a save_only_model checkpoint: all three
        scheduler = [SCHEDULER_NAME] if SCHEDULER_NAME in present else []
        for found, name in ((optimizer, OPTIMIZER_NAME), (scheduler, SCHEDULER_NAME), (rng, "rng_state.pth")):
            if not found:
                return os.path.join(checkpoint, name), "missing"
            files += [os.path.join(checkpoint, n) for n in found]
    for path in files:
        wrong = _file_damage(path)
        if wrong is not None:
            return wrong
    return None


def _file_damage(path: str) -> tuple[str, str] | None:
    if os.path.isdir(path):  # a distributed checkpoint (torch.distributed.checkpoint)
        metadata = os.path.join(path, ".metadata")
        return None if os.path.isfile(metadata) else (metadata, "missing (the shards were not all written)")
    if path.endswith(".json"):  # an index: each shard it names
        try:
            with open(path, encoding="utf-8") as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            return path, f"damaged (not a weights index: {e})"
        for shard in shards:
            shard = os.path.join(os.path.dirname(path), shard)
            wrong = (shard, "missing") if not os.path.isfile(shard) else _file_damage(shard)
            if wrong is not None:
                return wrong
        return None
    if path.endswith(".safetensors"):
        return _safetensors_damage(path)
    if not zipfile.is_zipfile(path):  # torch.save's archive: its directory is written last
        return path, f"damaged (not a whole torch.save archive, {os.path.getsize(path)} bytes: cut short?)"
    return None


def _safetensors_damage(path: str) -> tuple[str, str] | None:
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            (header_size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_size)) if 8 + header_size <= size else None
        if header is None:
            raise ValueError("its header is cut short")
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (struct.error, ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError) as e:
        return path, f"damaged (not a safetensors file: {e})"
    if size != 8 + header_size + end:
        return path, f"damaged ({size} bytes, its header says {8 + header_size + end}: cut short?)"
    return None


def _step(name: str) -> int | None:
    match = _STEP.match(name)
    return int(match.group(1)) if match else None


def _checkpoints(output_dir: str) -> list[str]:
    """output_dir's checkpoint-N directories, newest (highest N) first."""
    names = [n for n in os.listdir(output_dir) if _step(n) is not None and os.path.isdir(os.path.join(output_dir, n))]
    return [os.path.join(output_dir, n) for n in sorted(names, key=_step, reverse=True)]


def _fix(checkpoint: str) -> str:
    """What to do about a checkpoint that cannot be resumed: the newest earlier one that can."""
    parent, name = os.path.split(os.path.normpath(checkpoint))
    step = _step(name)
    earlier = [c for c in _checkpoints(parent) if step is not None and _step(os.path.basename(c)) < step] \
        if os.path.isdir(parent) else []
    usable = next((c for c in earlier if unfinished(c) is None and damage(c) is None), None)
    if usable is None:
        return f"delete {checkpoint} and train from the start (no earlier complete checkpoint beside it)"
    return f"resume from {usable}, or delete {checkpoint}"


def check_checkpoint(checkpoint: str) -> str:
    """``checkpoint`` if it can be resumed; else CheckpointError naming the file and the fix."""
    checkpoint = os.fspath(checkpoint)
    if not os.path.isdir(checkpoint):
        raise CheckpointError(f"{checkpoint} does not exist: give a checkpoint-N directory, or true for the latest "
                              "complete one in output_dir")
    why = unfinished(checkpoint)
    if why is not None:
        if _step(os.path.basename(os.path.normpath(checkpoint))) is None:
            raise CheckpointError(f"{checkpoint} is not a Trainer checkpoint (it has no valid {TRAINER_STATE_NAME}): "
                                  "give a checkpoint-N directory, or true for the latest complete one in output_dir")
        raise CheckpointError(f"{checkpoint} is {why}: {_fix(checkpoint)}")
    wrong = damage(checkpoint)
    if wrong is not None:
        raise CheckpointError(f"{wrong[0]} is {wrong[1]}: {_fix(checkpoint)}")
    _warn_if_data_passed_its_end(checkpoint)
    return checkpoint


def _warn_if_data_passed_its_end(checkpoint: str) -> None:
    """A training set without a length (an IterableDataset) that ended and was begun again
    before the checkpoint: the Trainer fast-forwards it from its start as if in its first pass."""
    with open(os.path.join(checkpoint, TRAINER_STATE_NAME), encoding="utf-8") as f:
        state = json.load(f)
    # the Trainer's mark of a dataset without a length; each end of it begins a new epoch
    if isinstance(state, dict) and state.get("num_train_epochs") == sys.maxsize and (state.get("epoch") or 0) > 1:
        logger.warning(f"{checkpoint} was saved after the training dataset (which has no length) ended and began "
                       "again; the Trainer fast-forwards it from its start as if it had not ended, so the resumed run "
                       "trains on other data than the interrupted one would have: make the dataset endless (its "
                       "__iter__ going on to the next pass) or map-style (a datasets.Dataset), whose position the "
                       "Trainer restores in any epoch")


def latest_checkpoint(output_dir: str) -> str | None:
    """What ``resume_from_checkpoint=True`` resumes: the newest checkpoint-N in output_dir
    whose save finished (each one skipped is logged, with why), checked whole. None when
    output_dir holds no checkpoint-N at all; CheckpointError when none finished."""
    found = _checkpoints(output_dir) if os.path.isdir(output_dir) else []
    skipped = []
    for checkpoint in found:
        why = unfinished(checkpoint)
        if why is None:
            for other, reason in skipped:
                logger.warning(f"resume_from_checkpoint=True: skipping {other}, {reason}; resuming from {checkpoint}")
            return check_checkpoint(checkpoint)
        skipped.append((checkpoint, why))
    if skipped:
        names = "; ".join(f"{os.path.basename(c)} is {why}" for c, why in skipped)
        raise CheckpointError(f"{output_dir} holds no complete checkpoint ({names}): give a checkpoint's path, or "
                              "delete them and train from the start")
    return None
