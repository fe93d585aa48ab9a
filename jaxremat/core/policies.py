"""Checkpoint policies by name: what a stage's store options are (``docs/cost_model.md``).

A store option ``k > 0`` of a stage is the stage under a ``jax.checkpoint`` policy, named in the
costs (``StageOption.name``) and resolved to the policy here, by the profiler that measures it
and by the executor that runs it. Built in, by their ``jax.checkpoint_policies`` names:
``dots_saveable`` and ``dots_with_no_batch_dims_saveable`` (the defaults), ``nothing_saveable``
and ``everything_saveable``. Other policies are given by name, e.g.
``policies={"qkv": jax.checkpoint_policies.save_only_these_names("q", "k", "v")}``.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence, Union

import jax
from jax import lax

Policy = Callable[..., Any]
#: What ``policies=`` takes: ``None`` (the defaults), a mapping of names to policies (added to the
#: defaults), or a sequence of built-in names (exactly those; ``()`` for no options).
Policies = Union[Mapping[str, Policy], Sequence[str], None]

BUILTIN: dict[str, Policy] = {
    name: getattr(jax.checkpoint_policies, name)
    for name in ("dots_saveable", "dots_with_no_batch_dims_saveable", "nothing_saveable", "everything_saveable")
}
DEFAULTS = ("dots_saveable", "dots_with_no_batch_dims_saveable")


def check_policy(name: str, policy: Any) -> Policy:
    """``policy`` if it is a checkpoint policy (a function of a primitive that says whether to
    save its output); ``ValueError`` naming it otherwise (e.g. a policy factory not called yet)."""
    if not callable(policy):
        raise ValueError(f"policy {name!r} is a {type(policy).__name__}, not a jax.checkpoint policy")
    try:
        answer = policy(lax.sin_p)
    except Exception as e:  # noqa: BLE001 - reported with the policy's name
        raise ValueError(
            f"policy {name!r} is not a jax.checkpoint policy: calling it on a primitive failed ({e})"
        ) from None
    if callable(answer):
        raise ValueError(
            f"policy {name!r} returned a function when asked about a primitive: it looks like a policy factory "
            "(such as save_only_these_names); call it first, e.g. save_only_these_names('q', 'k')"
        )
    return policy


def policies_of(policies: Policies) -> dict[str, Policy]:
    """The policies to measure as store options, by name (see :data:`Policies`)."""
    if policies is None:
        return {name: BUILTIN[name] for name in DEFAULTS}
    if isinstance(policies, Mapping):
        out = {name: BUILTIN[name] for name in DEFAULTS}
        for name, policy in policies.items():
            if not isinstance(name, str) or not name or name == "store_all":
                raise ValueError(f"a policy needs a name (a non-empty string other than 'store_all'), got {name!r}")
            out[name] = check_policy(name, policy)
        return out
    if isinstance(policies, str):
        policies = (policies,)
    unknown = [n for n in policies if n not in BUILTIN]
    if unknown:
        raise ValueError(
            f"unknown policy name(s) {unknown}; built in: {', '.join(BUILTIN)}; give others as "
            "policies={'name': policy}"
        )
    return {name: BUILTIN[name] for name in policies}


def resolve(name: str, policies: Mapping[str, Policy] | None, where: str) -> Policy:
    """The policy a store option named ``name`` runs under: from ``policies`` or built in;
    ``ValueError`` naming ``where`` (the stage and option) when neither has it."""
    if policies and name in policies:
        return check_policy(name, policies[name])
    if name in BUILTIN:
        return BUILTIN[name]
    raise ValueError(
        f"{where} is stored under policy {name!r}, which jaxremat does not know: pass it by name, "
        f"policies={{{name!r}: <the jax.checkpoint policy>}}"
    )


__all__ = ["BUILTIN", "DEFAULTS", "Policies", "Policy", "check_policy", "policies_of", "resolve"]
