"""The README's engine example runs as written against a real `tiercache serve`."""

import re
from pathlib import Path

from tiercache.service.process import CoordinatorProcess

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_engine_example_runs(make_config, tmp_path):
    text = README.read_text()
    section = text.split("## Using it from an engine", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    with CoordinatorProcess(make_config(), tmp_path) as coordinator:
        namespace = {"CONFIG_PATH": str(coordinator.config_path)}
        exec(compile(code, "README.md", "exec"), namespace)  # its asserts are the checks
        assert namespace["index"].stats().ready_blocks == 2
