"""Render the package's Sphinx-style roles as links in the API reference.

The docstrings cross-reference with ``:func:`name``` because that reads well in
``help()`` inside a notebook. mkdocstrings understands markdown cross-references
instead, so, once griffe has loaded the whole package, this extension rewrites
each role into ``[name][full.path]`` when the name resolves inside grafting_lens
(from the docstring's class, then its module and that module's imports, then the
package; an undocumented attribute links to its class), and into plain code otherwise (torch, transformers...), so that no
link points nowhere.
"""

from __future__ import annotations

import re

import griffe

_ROLE = re.compile(r":(?:func|class|data|meth|attr|mod|exc|obj):`(~?)([^`]+)`")


def _lookup(scope: griffe.Object, dotted: str) -> str | None:
    """Full path of ``dotted`` seen from ``scope``, following imports; None if not ours."""
    obj = scope
    for part in dotted.split("."):
        try:
            obj = obj.get_member(part)
        except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
            return None
        if isinstance(obj, griffe.Alias):
            try:
                obj = obj.final_target
            except (griffe.AliasResolutionError, griffe.CyclicAliasError):
                return None
    if obj.is_attribute and obj.docstring is None:
        # Undocumented attributes (dataclass fields described in their class's
        # "Attributes" section) get no anchor of their own: link to the class.
        return obj.parent.path
    return obj.path


def _resolve(obj: griffe.Object, target: str, package: griffe.Module) -> str | None:
    if target.startswith(package.name + "."):
        return target if _lookup(package, target[len(package.name) + 1 :]) else None
    scopes = [obj if obj.is_class else obj.parent, obj.module, package]
    for scope in scopes:
        if scope is not None and (path := _lookup(scope, target)):
            return path
    return None


class SphinxRoles(griffe.Extension):
    """Rewrite ``:role:`target``` in every docstring of the package."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: object) -> None:
        for obj in _walk(pkg):
            if obj.docstring is None:
                continue

            def replace(match: re.Match[str], obj: griffe.Object = obj) -> str:
                short, target = match.group(1) == "~", match.group(2)
                # Sphinx's explicit title, ``:meth:`Source.module <grafting_lens...>```
                # (the role may wrap over a docstring's lines).
                titled = re.fullmatch(r"(.+?)\s*<([^<>]+)>", " ".join(target.split()))
                if titled:
                    shown, target = titled.group(1), titled.group(2)
                else:
                    shown = target.rsplit(".", 1)[-1] if short else target
                path = _resolve(obj, target, pkg)
                return f"[`{shown}`][{path}]" if path else f"`{shown}`"

            obj.docstring.value = _ROLE.sub(replace, obj.docstring.value)


def _walk(obj: griffe.Object):
    yield obj
    for member in obj.members.values():
        if not member.is_alias and member.parent is obj:
            yield from _walk(member)
