"""Train the tiny Qwen3 family that hf-kvmap ships (see hf_kvmap/zoo/family/README.md).

    python examples/train_tiny_family.py                      # whole family, ~100 min on one CPU core
    python examples/train_tiny_family.py --members tiny-s     # one member
    python examples/train_tiny_family.py --force ...          # retrain members that already have weights

Re-running after an interruption resumes from runs/zoo/<name>/ (checkpoints every 100 steps).
"""

import sys
from pathlib import Path

try:
    from lab.zoo.train import main
except ImportError:  # running from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from lab.zoo.train import main

if __name__ == "__main__":
    main()
