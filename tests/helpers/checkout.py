"""The checkout the tests run from: the working directory and PYTHONPATH of the commands they
run as a user would from a checkout (`python -m switchyard.deploy.cli ...`)."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
