"""Root pytest configuration.

Shared, expensive fixtures (a prepared model, one vLLM engine per test session, running
services) live in tests/fixtures/<area>.py, one module per area, and are loaded here as
plugins so that every test module can use them.
"""

import os
from pathlib import Path

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

pytest_plugins = sorted(
    f"tests.fixtures.{p.stem}" for p in (Path(__file__).parent / "tests" / "fixtures").glob("*.py") if p.stem != "__init__"
)
