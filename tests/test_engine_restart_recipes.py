"""What a restarted engine process loads again (``client/restart.py``): each name's current load (after
new versions, rollbacks, unloads), its pin, and version ids after every id seen; the retry delays."""

from __future__ import annotations

from loraplex.adapters.versions import HeldVersion, NameView, VersionView
from loraplex.client.restart import AdapterRecipes, RestartPolicy


def test_recipes_follow_loads_versions_rollbacks_unloads_and_pins() -> None:
    recipes = AdapterRecipes([("boot", "/a/boot")])
    recipes.record("load_adapter", ("rt", "/a/rt1"), {"roots": ["/a"]})
    recipes.record("load_adapter", ("rt", "/a/rt2"), {"roots": ["/a"], "new_version": True})
    recipes.record("load_adapter", ("rt", "/a/rt3"), {"roots": ["/a"], "new_version": True})
    recipes.record("rollback_adapter", ("rt",), {})
    recipes.record("load_adapter", ("gone", "/a/g"), {})
    recipes.record("unload_adapter", ("gone",), {})
    recipes.record("pin_adapter", ("rt",), {})
    recipes.record("pin_adapter", ("boot",), {})
    recipes.record("unpin_adapter", ("boot",), {})
    assert recipes.replay() == [("load_adapter", ("boot", "/a/boot"), {}),
                                ("load_adapter", ("rt", "/a/rt2"), {"roots": ["/a"]}),
                                ("pin_adapter", ("rt",), {})]
    recipes.record("rollback_adapter", ("rt",), {})
    recipes.record("rollback_adapter", ("rt",), {})  # past what is recorded: not restored
    assert recipes.replay() == [("load_adapter", ("boot", "/a/boot"), {})]
    recipes.forget("boot")
    assert recipes.replay() == []


def test_version_ids_continue_after_every_id_seen() -> None:
    recipes = AdapterRecipes()
    held = HeldVersion(7, "x", "h", "/p", None, False)
    recipes.saw(VersionView(3, {"x": NameView(7, (), (held,))}))
    recipes.saw(VersionView(4, {}))  # dropped later: its id stays taken
    assert recipes.next_version_id == 8


def test_restart_delays_double_up_to_the_cap() -> None:
    assert list(RestartPolicy(max_attempts=5, backoff_s=0.5, max_backoff_s=3).delays()) == [0.5, 1, 2, 3, 3]
