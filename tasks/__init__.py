"""Zero-shot evaluation tasks (``python tasks/main.py --help``); the logic lives in megalite/inference/."""
