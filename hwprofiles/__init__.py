"""Hardware profiles: one YAML file per accelerator or system, validated by planner.specs."""
from pathlib import Path

PROFILE_DIR = Path(__file__).parent
