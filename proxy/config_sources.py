"""Where each setting came from (a config file's key, a ``PREFIX_PROXY_*`` variable, a flag), and
every configuration problem told in one line that names that source, the value and what is allowed.

An operator reads ``deploy/proxy.yaml: canon.mdoe: unknown key (did you mean 'mode'?)``, never a
traceback or a model's class name. Secrets are never echoed: a value under a key, secret, password or
token name is shown as hidden, and a URL's password is masked.
"""

from __future__ import annotations

import difflib
import json
import re
import tomllib
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, SecretStr, ValidationError
from pydantic.fields import FieldInfo

Location = Sequence[str | int]

# A flag's name where it is not the setting's (``--upstream`` sets ``upstreams`` when repeated).
FLAG_NAMES = {"upstreams": "upstream"}
# Parts of a setting's name that mark its value as a secret.
SECRET_NAMES = ("api_key", "secret", "password", "credentials")
MAX_SHOWN_CHARS = 80
# The error type of a problem found across settings (proxy.config.conflict): its context's ``loc``
# names the setting to blame, below the model that found it.
SETTING_CONFLICT = "setting_conflict"


class ConfigError(Exception):
    """One or more configuration problems, one line each (``problems``)."""

    def __init__(self, problems: Iterable[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


def read_config_file(path: Path) -> dict[str, Any]:
    """A YAML or TOML config file's settings; :class:`ConfigError` on any problem with the file."""
    suffix = path.suffix.lower()
    if not path.exists():
        raise ConfigError([f"{path}: config file not found (given by --config or PREFIX_PROXY_CONFIG)"])
    if suffix not in (".yaml", ".yml", ".toml"):
        kind = f"{suffix} file" if suffix else "file without an extension"
        raise ConfigError([f"{path}: a config file is YAML (.yaml, .yml) or TOML (.toml), not a {kind}"])
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) else "not UTF-8 text"
        raise ConfigError([f"{path}: cannot be read ({reason})"]) from None
    if suffix == ".toml":
        try:
            data: Any = tomllib.loads(text)
        except tomllib.TOMLDecodeError as error:
            raise ConfigError([f"{path}: not valid TOML: {error}"]) from None
    else:
        try:
            data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            where = f" line {mark.line + 1} column {mark.column + 1}:" if mark is not None else ""
            problem = getattr(error, "problem", None) or str(error).splitlines()[0]
            raise ConfigError([f"{path}:{where} not valid YAML: {problem}"]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: a config file maps settings to values (key: value), not a {type(data).__name__}"])
    keys = [key for key in data if not isinstance(key, str)]
    if keys:
        # YAML reads ``1:``, ``true:`` and ``null:`` as a number, a boolean and nothing: no setting's name.
        raise ConfigError([f"{path}: {keys[0]!r}: not a setting's name (a setting is named by a word): remove it"])
    return data


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping: YAML keeps the last and drops
    the first without a word, which would be a setting silently not applied."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # merged keys (``<<: *anchor``) are the mapping's to override
            key = self.construct_object(key_node, deep=deep)
            try:
                repeated = key in seen
            except TypeError:  # an unhashable key: the base class says so
                break
            if repeated:
                raise yaml.constructor.ConstructorError(
                    None, None, f"{key!r} is given twice in one mapping: keep one", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


# What Kubernetes puts in the environment of every pod for each Service of its namespace (service
# links, on unless the pod sets enableServiceLinks: false). For a Service named prefix-proxy:
# PREFIX_PROXY_SERVICE_HOST, PREFIX_PROXY_SERVICE_PORT[_<port name>], PREFIX_PROXY_PORT=tcp://10.0.0.1:8080
# and PREFIX_PROXY_PORT_8080_TCP[_PROTO|_PORT|_ADDR]: the proxy's own prefix, where PREFIX_PROXY_PORT
# read as the listen port would fail every pod started after the Service. A family is recognized
# by its SERVICE_HOST variable beside an address-shaped PORT; a setting the operator gives in the
# pod's own env keeps its plain value (the container's env replaces a link of the same name), so
# it is never taken for one.
_LINK_ADDRESS = re.compile(r"(tcp|udp|sctp)://[^\s/]+:\d+", re.IGNORECASE)
_LINK_PORT = re.compile(r"_PORT_\d+_(TCP|UDP|SCTP)(_PROTO|_PORT|_ADDR)?")


def service_links(environ: Mapping[str, str]) -> set[str]:
    """The names in ``environ`` (upper-cased) that Kubernetes set as a Service's links."""
    upper = {name.upper(): value for name, value in environ.items()}
    links = set()
    for host in upper:
        stem = host.removesuffix("_SERVICE_HOST")
        if stem == host:
            continue
        family = {name[len(stem) :]: value for name, value in upper.items() if name.startswith(stem + "_")}
        # An address (tcp://10.0.0.1:8080) is what only a link holds; a name the operator set keeps its value.
        addresses = {rest for rest, value in family.items() if _LINK_ADDRESS.fullmatch(value)}
        ports = {rest for rest in addresses if rest == "_PORT" or _LINK_PORT.fullmatch(rest)}
        if not ports:
            continue
        for rest in family:
            found = _LINK_PORT.fullmatch(rest)
            named = rest in ("_SERVICE_HOST", "_SERVICE_PORT") or rest.startswith("_SERVICE_PORT_")
            if named or rest in ports or (found and found[2] and rest[: found.start(2)] in ports):
                links.add(stem + rest)
    return links


@dataclass(frozen=True)
class Sources:
    """What the settings were built from."""

    file: Path | None
    file_data: Mapping[str, Any]
    flags: Mapping[str, Any]
    # The ``prefix`` variables of the environment, names upper-cased (matching is case-insensitive).
    environment: Mapping[str, str]
    prefix: str
    # Each of those names as the environment spells it.
    spelled: Mapping[str, str] = field(default_factory=dict)
    # The ``prefix`` variables Kubernetes set as service links, not settings (:func:`service_links`).
    links: frozenset[str] = frozenset()

    @classmethod
    def gather(cls, file: Path | None, flags: Mapping[str, Any], environ: Mapping[str, str], prefix: str) -> Sources:
        data = read_config_file(file) if file is not None else {}
        links = frozenset(name for name in service_links(environ) if name.startswith(prefix))
        names = {name.upper(): name for name in environ if name.upper().startswith(prefix)}
        names = {upper: name for upper, name in names.items() if upper not in links}
        variables = {upper: environ[name] for upper, name in names.items()}
        return cls(file, data, dict(flags), variables, prefix, names, links)

    def origin(self, loc: Location) -> str:
        """Where the value at ``loc`` came from: ``--port``, ``PREFIX_PROXY_PORT``, ``FILE: canon.mode``
        or ``default``."""
        if loc and str(loc[0]) in self.flags:
            return f"--{FLAG_NAMES.get(str(loc[0]), str(loc[0])).replace('_', '-')}"
        variable = self._variable(loc)
        if variable is not None:
            return variable
        if self.file is not None and loc and _holds(self.file_data, loc):
            return f"{self.file}: {dotted(loc)}"
        return "default"

    def where(self, loc: Location) -> str:
        """The source to name in a problem about ``loc``, with the key when the source is shallower."""
        origin = self.origin(loc)
        if origin == "default" and loc:
            indexed = self._indexed_variable(loc)
            if indexed is not None:
                return indexed
        if origin == "default":
            # A missing key: the source of the section that lacks it.
            parents = (self.origin(loc[:depth]) for depth in range(len(loc) - 1, 0, -1))
            parent = next((origin for origin in parents if origin != "default"), None)
            if parent is None or parent.startswith("--"):
                return dotted(loc) if loc else "config"
            head = parent.split(": ", 1)[0]
            return f"{head}: {dotted(loc)}"
        variable = self._variable(loc)
        if variable is not None and variable.count("__") + 1 < len(loc):
            return f"{variable}: {dotted(loc)}"
        return origin

    def _indexed_variable(self, loc: Location) -> str | None:
        """A variable that gives a list setting item by item (``PREFIX_PROXY_TENANTS__0__NAME``), which
        the environment cannot: named, with the form it takes (the whole list, as JSON)."""
        stem = self.prefix + "__".join(str(part).upper() for part in loc) + "__"
        for name in sorted(self.environment):
            if name.startswith(stem) and name[len(stem) :].split("__", 1)[0].isdigit():
                whole = stem[:-2]
                return f"{name} (a list is one variable holding JSON: {whole}='[...]', not one per item)"
        return None

    def unknown_variables(self, model: type[BaseModel], allowed: Iterable[str] = ()) -> list[str]:
        """Problems for ``prefix`` variables that name no setting (nested ones are the model's to judge).

        The hint is the closest variable that does name one, nested ones spelt with ``__``
        (``PREFIX_PROXY_CANON_MODE``: did you mean ``PREFIX_PROXY_CANON__MODE``?)."""
        known = set(model.model_fields)
        names = variable_names(model)
        exempt = {name.upper() for name in allowed}
        problems = []
        for name in sorted(self.environment):
            rest = name[len(self.prefix) :].lower()
            if name in exempt or rest.split("__", 1)[0] in known:
                continue
            # One '_' written for the '__' between a section and its key is the likeliest slip.
            squeezed = {candidate.replace("_", ""): candidate for candidate in names}
            match = [squeezed[rest.replace("_", "")]] if rest.replace("_", "") in squeezed else []
            match = match or difflib.get_close_matches(rest, names, n=1)
            hint = f" (did you mean {self.prefix}{match[0].upper()}?)" if match else ""
            problems.append(f"{name}: unknown setting{hint}")
        problems.extend(self._keyed_variables(model))
        return problems

    def _keyed_variables(self, model: type[BaseModel]) -> list[str]:
        """Variables that give one key of a mapping setting with capitals in it
        (``PREFIX_PROXY_MODEL_BUDGETS__Qwen/...``): the environment's names are read in lower case, so
        the key (a model's name) would silently never match. Named, with the form that keeps it (the
        mapping as JSON); a key in lower case is read as written."""
        problems = []
        for name in sorted(self.environment):
            spelled = self.spelled.get(name, name)[len(self.prefix) :].split("__")
            parts = [part.lower() for part in spelled]
            for depth in range(1, len(parts)):
                found = _setting(model, parts[:depth])
                if found is None:
                    break
                if typing.get_origin(found[0]) is not dict:
                    continue
                if spelled[depth] != parts[depth]:  # a key in lower case is read as written
                    whole = self.prefix + "__".join(parts[:depth]).upper()
                    problems.append(
                        f"{self.spelled.get(name, name)}: a key with capitals cannot be given in a variable's name "
                        f"(names are read in lower case): give the whole mapping as JSON, {whole}='{{\"Key\": ...}}'"
                    )
                break
        return problems

    def _variable(self, loc: Location) -> str | None:
        """The variable that gave the value at ``loc``: its own, or a section's whose JSON holds it
        (a section's variable and the file's keys of that section are merged)."""
        for depth in range(len(loc), 0, -1):
            if any(isinstance(part, int) for part in loc[:depth]):
                continue
            name = self.prefix + "__".join(str(part) for part in loc[:depth]).upper()
            if name not in self.environment:
                continue
            if depth == len(loc):
                return name
            try:
                value = json.loads(self.environment[name])
            except ValueError:
                return name  # not JSON: the problem is the variable's
            if _holds(value, loc[depth:]):
                return name
        return None


def variable_names(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every setting of ``model`` as a variable spells it (less the prefix): ``canon__mode``."""
    names = []
    for name, field_info in model.model_fields.items():
        names.append(prefix + name)
        section = _unwrapped(field_info.annotation)
        if isinstance(section, type) and issubclass(section, BaseModel):
            names.extend(variable_names(section, f"{prefix}{name}__"))
    return names


def explain_settings_error(error: Exception, model: type[BaseModel], sources: Sources) -> list[str]:
    """One line for a value the settings sources could not decode: a variable that holds a list or
    a section must hold JSON (``PREFIX_PROXY_TENANTS='[{"name": ..., "api_key": ...}]'``)."""
    match = re.search(r'field "([^"]+)"', str(error))
    field_name = match.group(1) if match else None
    for name, value in sorted(sources.environment.items()):
        parts = name[len(sources.prefix) :].lower().split("__")
        shape = _holds_json(model, parts) if parts[0] == field_name else None
        if shape is None:
            continue
        try:
            json.loads(value)
        except ValueError as decoding:
            reason = decoding.msg if isinstance(decoding, json.JSONDecodeError) else str(decoding)
            written = "a list: write it as JSON, [...]" if shape == "list" else "a section: write it as JSON, {...}"
            return [f"{name}: not JSON ({reason}): this setting is {written}"]
    where = f"{sources.prefix}{field_name.upper()}" if field_name else "environment"
    cause = error.__cause__ or error
    return [f"{where}: cannot be read: {str(cause).splitlines()[0] if str(cause) else type(cause).__name__}"]


def _setting(model: type[BaseModel], parts: Sequence[str]) -> tuple[Any, FieldInfo] | None:
    """The type (``X`` of ``X | None``) and field of the setting ``parts`` name, a section's key at a
    time; None where they name none."""
    section: Any = model
    field_info = None
    for part in parts:
        if not (isinstance(section, type) and issubclass(section, BaseModel)) or part not in section.model_fields:
            return None
        field_info = section.model_fields[part]
        section = _unwrapped(field_info.annotation)
    return (section, field_info) if field_info is not None else None


def _holds_json(model: type[BaseModel], parts: Sequence[str]) -> str | None:
    """The shape ("list" or "object") of the setting a variable names (``parts``) when it is read from
    the variable as JSON, as pydantic-settings reads a list, a mapping or a section (not ``NoDecode``)."""
    found = _setting(model, parts)
    if found is None or any(type(item).__name__ == "NoDecode" for item in found[1].metadata):
        return None
    section = found[0]
    origin = typing.get_origin(section)
    if origin in (list, tuple, set, frozenset):
        return "list"
    if origin is dict or (isinstance(section, type) and issubclass(section, BaseModel)):
        return "object"
    return None


def explain(error: ValidationError, model: type[BaseModel], sources: Sources) -> list[str]:
    """One line per problem of ``error`` (raised validating ``model``)."""
    problems = []
    for item in error.errors():
        loc = tuple(item.get("loc") or ())
        kind = item.get("type", "")
        context = item.get("ctx") or {}
        if kind == SETTING_CONFLICT:
            # Found across settings: the one it names is the one to blame; its value is not shown.
            loc = (*loc, *context.get("loc", ()))
            problems.append(f"{sources.where(loc)}: {context.get('message', item.get('msg', 'invalid'))}")
            continue
        if kind == "extra_forbidden":
            section = section_at(model, loc[:-1])
            known = list(section.model_fields) if section is not None else []
            match = difflib.get_close_matches(str(loc[-1]), known, n=1)
            problem = "unknown key" + (f" (did you mean {match[0]!r}?)" if match else "")
        elif kind == "missing":
            problem = "required, not set"
        else:
            message = str(item.get("msg", "invalid"))
            message = message.removeprefix("Value error, ").removeprefix("Assertion failed, ")
            problem = message[:1].lower() + message[1:]
            shown = _shown(loc, item.get("input"))
            if shown is not None:
                problem += f" (got {shown})"
        problems.append(f"{sources.where(loc)}: {problem}")
    return problems


def problem_line(sources: Sources, loc: Location, message: str, value: Any = None) -> str:
    """A problem with the setting at ``loc`` as :func:`explain` tells one: its source, what is wrong,
    and the value when it can be shown."""
    shown = _shown(loc, value) if value is not None else None
    return f"{sources.where(loc)}: {message}" + (f" (got {shown})" if shown is not None else "")


def effective(settings: BaseModel, sources: Sources) -> list[str]:
    """``key = value  [source]`` for every setting, secrets masked."""
    lines: list[str] = []

    def walk(section: BaseModel, prefix: tuple[str, ...]) -> None:
        for name in type(section).model_fields:
            value = getattr(section, name)
            loc = (*prefix, name)
            if isinstance(value, BaseModel):
                walk(value, loc)
            else:
                lines.append(f"{dotted(loc)} = {_rendered(loc, value)}  [{sources.origin(loc)}]")

    walk(settings, ())
    return lines


def section_at(model: type[BaseModel], loc: Location) -> type[BaseModel] | None:
    """The settings section (model class) at ``loc`` under ``model``, if it is one."""
    annotation: Any = model
    for part in loc:
        annotation = _unwrapped(annotation)
        origin = typing.get_origin(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            field_info = annotation.model_fields.get(str(part))
            if field_info is None:
                return None
            annotation = field_info.annotation
        elif origin in (list, tuple, set, frozenset):
            annotation = typing.get_args(annotation)[0]
        elif origin is dict:
            annotation = typing.get_args(annotation)[1]
        else:
            return None
    annotation = _unwrapped(annotation)
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def dotted(loc: Location) -> str:
    """``tenants[0].api_key`` for ``("tenants", 0, "api_key")``."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


# A URL's host and port as a parser reads them.
_WELL_FORMED_AUTHORITY = re.compile(r"[\w.-]+(:\d+)?|\[[0-9A-Fa-f:.]+\](:\d+)?")


def masked_url(value: str) -> str:
    """``value`` with a URL's password replaced by ``***``. The user part ends at the last ``@``
    before the host: of the authority where the host after it is well formed (an ``@`` in the path
    or query is no password's end), else of the whole text: a password with an unencoded ``#``, ``?``
    or ``/`` (generated passwords have them) ends a parser's netloc early, so it finds no password,
    while the text still holds it (and a problem line about that URL would print it). Where it is
    ambiguous, it masks."""
    scheme, separator, rest = value.partition("://")
    if not separator:
        return value
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    userinfo, at, host = authority.rpartition("@")
    if at and _WELL_FORMED_AUTHORITY.fullmatch(host):
        tail = rest[len(authority) :]
    elif not at and (":" not in authority or "@" not in rest):
        # No user part: a password needs its ':' before the first delimiter (an '@' in a path, as
        # Cloudflare's @cf/ model names, is kept). A host:port with an '@' later stays ambiguous
        # (user:1234#rest@host), and is masked as a password would be.
        return value
    else:
        userinfo, at, host = rest.rpartition("@")
        if not at:
            return value
        tail = ""
    user, colon, _ = userinfo.partition(":")
    if not colon:
        return value  # a user name alone
    return f"{scheme}://{user}:***@{host}{tail}"


def _unwrapped(annotation: Any) -> Any:
    """``X`` for ``X | None`` and ``Annotated[X, ...]``."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _unwrapped(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(members) == 1:
            return _unwrapped(members[0])
    return annotation


def _holds(data: Any, loc: Location) -> bool:
    for part in loc:
        if isinstance(data, list) and isinstance(part, int) and 0 <= part < len(data):
            data = data[part]
            continue
        if not isinstance(data, dict) or part not in data:
            return False
        data = data[part]
    return True


def _is_secret(loc: Location) -> bool:
    return any(
        isinstance(part, str)
        and (any(name in part.lower() for name in SECRET_NAMES) or part.lower().endswith(("_token", "token")))
        for part in loc
    )


def _shown(loc: Location, value: Any) -> str | None:
    """The offending value as a problem line shows it; None for one too big or too secret to show."""
    if _is_secret(loc):
        return "a hidden value"
    if isinstance(value, str):
        text = masked_url(value)
        return repr(text if len(text) <= MAX_SHOWN_CHARS else text[:MAX_SHOWN_CHARS] + "...")
    if value is None or isinstance(value, bool | int | float):
        return json.dumps(value)
    return None


def _rendered(loc: Location, value: Any) -> str:
    if value is not None and not isinstance(value, SecretStr) and _is_secret(loc):
        return '"********"'
    return json.dumps(_plain(value), ensure_ascii=False)


def _plain(value: Any) -> Any:
    """JSON-ready, secrets masked (tenants' keys included)."""
    if isinstance(value, BaseModel):
        return _plain(value.model_dump())
    if isinstance(value, SecretStr):
        return "********" if value.get_secret_value() else ""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_plain(v) for v in value]
    if isinstance(value, str):
        return masked_url(value)
    return value
