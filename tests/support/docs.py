"""What the tests read out of the docs: the curl quick start of docs/api.md (the JSON config and the commands)."""

from __future__ import annotations

import json
import re

from tests.support import ROOT

API_DOC = ROOT / "docs" / "api.md"


def quick_start() -> tuple[dict, str]:
    """The run config (the ```json block) and the shell commands (the ```bash block) of docs/api.md's quick start."""
    text = API_DOC.read_text()
    section = text.split("### Quick start with curl", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    config = re.search(r"```json\n(.*?)```", section, re.S).group(1)
    script = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return json.loads(config), script
