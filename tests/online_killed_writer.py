"""The process `tests/e2e/test_online_kill_e2e.py` kills: a draft learning online on the copy
pair writes checkpoints v1 and v2 into DIR, then blocks halfway through writing v3's weights
and says so; the test SIGKILLs it there.

    python tests/online_killed_writer.py COPY_DIR DIR
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from online_traffic import KeepAll, learning_engine, prompts

from specmesh.draft_service.online import checkpoints
from specmesh.protocol.sampling import SamplingParams


def _half_written(tensors: dict, path: str, metadata: dict | None = None) -> None:
    Path(path).write_bytes(b"\0" * 1000)  # the start of a file that is never finished
    print("WRITING", flush=True)
    time.sleep(3600)


def main(copy_dir: Path, root: Path) -> None:
    engine, learner = learning_engine(copy_dir)
    learner.checkpoints = checkpoints.Checkpoints(root, copy_dir / "eagle3", torch.float32, 2)
    learner.guard = KeepAll()
    engine.generate(prompts(9, seed=0), SamplingParams(max_new_tokens=24))
    learner.update()
    learner.update()  # v1, v2 on disk, `latest` names v2
    print(f"SAVED {learner.checkpoints.latest().version}", flush=True)
    checkpoints.save_file = _half_written
    learner.update()  # v3: killed inside


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
