"""What the tests and the benchmarks that drive `eagle3 run` in a process of its own share: the
tiny run's arguments (a 4-layer H64 verifier, one epoch, one eval prompt: about 90 s on two cores
from nothing), and what is left of a run's processes."""

from __future__ import annotations

from pathlib import Path

__all__ = ["alive", "descendants", "tiny_run_args"]


def tiny_run_args(store: Path, verifier: Path, conversations: Path) -> list[str]:
    """`eagle3` arguments of the tiny run; a caller adds what it changes (later overrides win)."""
    return [
        "run",
        f"store_dir={store}",
        f"verifier.path={verifier}",
        f"dataset.path={conversations}",
        "dataset.max_seq_len=256",
        "extract.aux_layer_ids=[1,2,3]",
        "vocab.draft_vocab_size=512",
        "train.epochs=1",
        "train.total_seq_len=512",
        "evaluate.num_prompts=1",
        "evaluate.max_new_tokens=8",
        "evaluate.ks=[3]",
    ]


def alive(pid: int) -> bool:
    """Running, not a zombie waiting to be reaped (a container's init may never reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def descendants(pid: int) -> set[int]:
    """Every process below `pid`, from /proc (Linux)."""
    children = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children |= {int(c) for c in (task / "children").read_text().split()}
        except OSError:
            continue
    return children.union(*(descendants(c) for c in children)) if children else set()
