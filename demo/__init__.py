"""A small target + EAGLE-3 draft pair trained from scratch on Python sources (CPU or one GPU).

`make_demo(out_dir)` writes `out_dir/target/` (a `LlamaForCausalLM`), `out_dir/draft/` (a
SpecForge/SGLang-format EAGLE-3 draft) and a model card; the committed pair is `models/demo/`.
`python -m specmesh.demo.compare PAIR_DIR ...` scores pairs side by side (bits/byte, acceptance).
"""

from specmesh.demo.card import DemoReport
from specmesh.demo.make import make_demo

__all__ = ["DemoReport", "make_demo"]
