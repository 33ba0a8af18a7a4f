"""Every objective (dtrain/objectives/: OBJECTIVES) is an entry point wherever a user meets one: the
package's description names it. Each rule reads OBJECTIVES, so an objective added there (dtrain.grpo,
dtrain.distill) fails here until it is everywhere."""

from __future__ import annotations

import re

from dtrain.objectives import OBJECTIVES
from tests.helpers import ROOT


def test_the_package_description_names_every_objective():
    (description,) = re.findall(r'^description = "(.*)"$', (ROOT / "pyproject.toml").read_text(), re.M)
    missing = [name for name in OBJECTIVES if name not in description.lower()]
    assert not missing, f"pyproject.toml's description does not name {missing}: {description!r}"
