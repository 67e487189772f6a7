"""The survivor modes' membership (app/ft/membership.py): torchft's Replica and inplace's InPlaceGroup
both implement the one interface the step loop uses, with the same signatures."""
from __future__ import annotations

import inspect
import typing

import pytest

from app.ft.inplace import InPlaceGroup
from app.ft.membership import Membership
from app.ft.replica import Replica

METHODS = sorted(name for name, member in vars(Membership).items()
                 if inspect.isfunction(member) and not name.startswith("_"))
PROPERTIES = sorted(name for name, member in vars(Membership).items() if isinstance(member, property))


@pytest.mark.unit
@pytest.mark.parametrize("mode", [Replica, InPlaceGroup], ids=lambda c: c.__name__)
def test_each_survivor_mode_implements_the_membership_interface(mode):
    assert METHODS, "the interface names its methods"
    for name in METHODS:
        assert inspect.signature(getattr(mode, name)) == inspect.signature(getattr(Membership, name)), name
    # `errored`, `backend` and `lineage` are read, never called: a property, or an attribute the class declares.
    assert PROPERTIES == ["backend", "errored", "lineage"]
    for name in PROPERTIES:
        assert isinstance(getattr(mode, name, None), property) or name in typing.get_type_hints(mode), (mode, name)


@pytest.mark.unit
def test_the_interface_is_all_the_step_loop_uses_of_a_membership():
    """app/ft/trainer.py calls nothing on its membership that the interface does not declare."""
    from pathlib import Path

    import re

    text = (Path(__file__).resolve().parent.parent / "app" / "ft" / "trainer.py").read_text()
    used = set(re.findall(r"self\.replica\.(\w+)", text))
    assert used <= set(METHODS) | set(PROPERTIES), used - set(METHODS)
