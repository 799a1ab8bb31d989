"""The cost model's plans and generated kernels of the shipped specs, as recorded before the
kernel families moved into modules of their own (issue 45): ``python tests/golden_plans.py``
rewrites ``tests/golden/plans.json`` (``python tests/golden_plans.py llama``: that case's entry only)
(kernel sources as generated for the Triton interpreter) (run it only for a change meant to alter the plans)."""
import hashlib
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # as tests/conftest.py sets it without a GPU: the kernels' sources differ

from datamove.cli import main  # noqa: E402

CASES = {  # name: main-job arguments (CPU: the cost model's plan)
    "bert": ["configs/bert.py"],
    "gpt2": ["configs/gpt2.py"],
    "llama": ["configs/llama.py"],
    "gpt2-small-fp16": ["configs/gpt2.py", "--dims", "B=1,T=64,D=128,H=2,E=64,F=256", "--dtype", "fp16"],
    "bert-two-shapes": ["configs/bert.py", "--dims", "B=2,L=128|64"],
}
GOLDEN = Path(__file__).parent / "golden" / "plans.json"


def record(name: str, out: Path) -> dict:
    """The plans (less their search's wall time) and a digest of each generated kernel's source."""
    assert main([*CASES[name], "--out", str(out)]) == 0
    plans = {}
    for path in [out / "plan.json", *sorted((out / "plans").glob("*.json"))]:
        plan = json.loads(path.read_text())
        plan["search"].pop("seconds", None)
        plans[str(path.relative_to(out))] = plan
    kernels = {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
               for p in sorted((out / "kernels").rglob("*.py"))}
    return {"plans": plans, "kernels": kernels}


if __name__ == "__main__":
    import tempfile
    names = sys.argv[1:] or list(CASES)
    recorded = json.loads(GOLDEN.read_text()) if sys.argv[1:] else {}
    with tempfile.TemporaryDirectory() as tmp:
        recorded.update({name: record(name, Path(tmp) / name) for name in names})
    GOLDEN.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}", file=sys.stderr)
