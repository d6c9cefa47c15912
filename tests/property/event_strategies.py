"""Hypothesis strategies for plain JSON values and for every event type of the vocabulary."""

from __future__ import annotations

import types
import typing
from typing import Any

import msgspec
from hypothesis import strategies as st

from wal_engine import events

storable_text = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
    max_size=40,
)
storable_floats = st.floats(allow_nan=False, allow_infinity=False)
storable_ints = st.integers(min_value=-(2**63), max_value=2**63 - 1)

json_values: st.SearchStrategy[Any] = st.recursive(
    st.none() | st.booleans() | storable_ints | storable_floats | storable_text,
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(storable_text, children, max_size=4),
    max_leaves=12,
)


def strategy_for(annotation: Any) -> st.SearchStrategy[Any]:
    """A strategy producing storable values of one field annotation."""
    if annotation is Any:
        return json_values
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*(strategy_for(arg) for arg in typing.get_args(annotation)))
    if origin is list:
        return st.lists(strategy_for(typing.get_args(annotation)[0]), max_size=3)
    if origin is dict:
        key, value = typing.get_args(annotation)
        return st.dictionaries(strategy_for(key), strategy_for(value), max_size=3)
    if isinstance(annotation, type) and issubclass(annotation, msgspec.Struct):
        return struct_strategy(annotation)
    simple: dict[Any, st.SearchStrategy[Any]] = {
        str: storable_text, int: storable_ints, float: storable_floats, bool: st.booleans(),
        type(None): st.none(),
    }
    return simple[annotation]


def struct_strategy(cls: type[msgspec.Struct]) -> st.SearchStrategy[Any]:
    """Build any struct of the vocabulary from strategies for each of its fields."""
    hints = typing.get_type_hints(cls)
    fields = {name: strategy_for(hints[name]) for name in cls.__struct_fields__}
    return st.builds(cls, **fields)


any_event: st.SearchStrategy[events.Event] = st.one_of(
    *(struct_strategy(cls) for cls in events.EVENT_TYPES.values())
)
