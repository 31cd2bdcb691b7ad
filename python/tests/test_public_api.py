"""The package's public namespace: every exception exported, nothing else leaking."""

import inspect
import types

import cumulus
from cumulus import errors


def test_every_exception_is_exported_at_the_top_level() -> None:
    defined = {
        name
        for name, obj in vars(errors).items()
        if inspect.isclass(obj) and issubclass(obj, (errors.CumulusError, Warning))
    }
    assert "SubmitWarning" in defined
    assert defined == set(errors.__all__)
    for name in defined:
        assert name in cumulus.__all__, name
        assert getattr(cumulus, name) is getattr(errors, name)


def test_the_namespace_holds_only_the_public_api_and_submodules() -> None:
    public = {n for n in dir(cumulus) if not n.startswith("_")}
    submodules = {n for n in public if isinstance(getattr(cumulus, n), types.ModuleType)}
    assert public - submodules <= set(cumulus.__all__), public - submodules - set(cumulus.__all__)
    for leaked in ("Any", "TYPE_CHECKING", "annotations"):
        assert leaked not in public
    for name in cumulus.__all__:
        assert getattr(cumulus, name) is not None


def test_states_are_the_contracts_string_enums() -> None:
    from cumulus import _contract

    for name in ("JobState", "RankPhase", "WorkerState", "MemberRole"):
        cls = getattr(cumulus, name)
        assert cls is getattr(_contract, name), name
        assert name in cumulus.__all__
        for member in cls:
            # A member is its wire spelling: equal, hashed, printed and formatted as it.
            assert member == member.value
            assert {member.value: 1}[member] == 1
            assert str(member) == member.value
            assert f"{member:>12}" == f"{member.value:>12}"
    info = cumulus.JobInfo.from_json({"id": "job-000001", "state": "running"})
    assert info.state == "running"
    assert info.state is cumulus.JobState.RUNNING
