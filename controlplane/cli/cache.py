"""``infergate cache stats|purge|calibrate``: the response cache from the shell.

- ``infergate cache calibrate --pairs FILE [--route R] [--model M] [--namespace-prefix P]
  [--max-wrong 0.01] [--config FILE] [--train-verifier FILE] [--allow-overlap]``:
  thresholds of a semantic-cache domain from labelled pairs
  (:mod:`controlplane.embedder.tuning`): chosen on a fit part of the pairs, checked on the
  rest (split by text), printed as tables of hit rate against wrong-hit rate and written
  to ``[[cache.semantic_domains]]`` of the config (no Redis). Refused on pairs the
  verifier was trained on (its fingerprint) unless ``--allow-overlap``;
  ``--train-verifier`` gives the domain a verifier of its own.

- ``infergate cache stats [--json]``: entries, estimated memory, counters and hit rates
  (0-1) from :func:`controlplane.cache.store.stats`.
- ``infergate cache purge --tenant T --model M --namespace N`` (any of them, combined
  with AND) or ``--all``: deletes the entries, their index memberships and their
  semantic-index vectors (``infergate:v1:cache:vec:*``) through the same operation as the
  admin API and page (:func:`controlplane.admin.ops.purge_cache`), which writes a
  ``cache_purge`` event with actor ``cli:<user>``. ``--all`` asks for confirmation unless
  ``--yes`` or the cache is empty; without a terminal to ask on it needs ``--yes``.

Errors (no scope, bad value, Redis unreachable) exit 1 with a message.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING

import click

from controlplane.admin import ops
from controlplane.cache import store as cache_store
from controlplane.cli.nodes import Ctx, actor, run, table
from controlplane.cli.common import ConnectedGroup

if TYPE_CHECKING:
    from controlplane.embedder.calibration import Pairs
    from controlplane.embedder.tuning import CalibrationResult


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.1f}%"


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 1048576:.2f} MiB"


@click.group("cache", cls=ConnectedGroup)
@click.option("--config", "config", type=click.Path(dir_okay=False), default=None,
              help="infergate TOML file (default: built-in defaults).")
@click.option("--redis-url", default=None, help="Redis URL; overrides the config file.")
@click.pass_context
def cache_cmd(ctx: click.Context, config: str | None, redis_url: str | None) -> None:
    """Response cache: counters and hit rates, purge, and calibrating a domain's semantic
    thresholds on labelled pairs."""
    ctx.obj = Ctx(config, redis_url)


@cache_cmd.command("stats")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
@click.pass_obj
def stats_cmd(c: Ctx, as_json: bool) -> None:
    """Entries, memory, counters and hit rates of the response cache."""
    st = run(c, lambda: cache_store.stats(c.r))
    if as_json:
        click.echo(json.dumps(st.to_dict(), indent=2))
        return
    rows = [
        ("entries", str(st.entries)),
        ("memory (entries, estimated)", _mib(st.memory_bytes)),
        ("redis used_memory", _mib(st.redis_used_memory)),
        ("lookups", str(st.lookups)),
        ("hits exact", str(st.hits_exact)),
        ("hits semantic", str(st.hits_semantic)),
        ("misses", str(st.misses)),
        ("bypass", str(st.bypass)),
        ("stores", str(st.stores)),
        ("hit rate", _rate(st.hit_rate)),
        ("hit rate exact", _rate(st.hit_rate_exact)),
        ("hit rate semantic", _rate(st.hit_rate_semantic)),
    ]
    click.echo(table(("figure", "value"), rows))


@cache_cmd.command("purge")
@click.option("--tenant", default=None, help="Only entries of this tenant.")
@click.option("--model", default=None, help="Only entries of this model.")
@click.option("--namespace", default=None, help="Only entries of this semantic namespace (hex).")
@click.option("--all", "purge_all", is_flag=True, help="Every entry, index and vector.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation of --all.")
@click.pass_obj
def purge_cmd(c: Ctx, tenant: str | None, model: str | None, namespace: str | None,
              purge_all: bool, yes: bool) -> None:
    """Delete cache entries and their vectors by tenant/model/namespace (AND), or all."""
    scoped = any(v not in (None, "") for v in (tenant, model, namespace))
    if purge_all and scoped:
        raise click.UsageError("--all cannot be combined with --tenant/--model/--namespace")
    if not purge_all and not scoped:
        raise click.UsageError("give --tenant, --model, --namespace or --all")
    if purge_all and not yes:
        n = run(c, lambda: cache_store.estimate(c.r, all=True))
        if n and not can_ask():
            raise click.UsageError(f"--all would delete {n} cache entries: add --yes to "
                                   "confirm (there is no terminal to ask on)")
        if n:
            click.confirm(f"Delete all {n} cache entries?", abort=True)

    data = {"all": True} if purge_all else {
        k: v for k, v in (("tenant", tenant), ("model", model), ("namespace", namespace))
        if v not in (None, "")}
    res = run(c, lambda: ops.purge_cache(c.r, data, actor(), c.events_max))
    scope = ", ".join(f"{k}={v}" for k, v in res.scope.items())
    click.echo(f"purged {res.purged} entries, {res.vectors} vectors ({scope})")


def can_ask() -> bool:
    """Whether a confirmation can be asked: standard input is a terminal."""
    return sys.stdin.isatty()


def _check_domain(no_verifier: bool, train_out: str | None, namespace_prefix: str,
                  route: str, model: str) -> None:
    """Raise ``click.UsageError`` / ``click.BadParameter`` for options that cannot name a
    domain or exclude each other."""
    from controlplane.config import PATH_RE

    if no_verifier and train_out:
        raise click.UsageError("--no-verifier and --train-verifier exclude each other")
    if train_out and not (route or model or namespace_prefix):
        raise click.UsageError("--train-verifier needs the domain it is for: --route, --model "
                               "or --namespace-prefix (the other domains keep their verifier)")
    if namespace_prefix and not all(ch in "0123456789abcdef" for ch in namespace_prefix):
        raise click.BadParameter("lowercase hex digits", param_hint="--namespace-prefix")
    if route and not PATH_RE.match(route):
        raise click.BadParameter("a request path such as /v1/chat/completions",
                                 param_hint="--route")
    if model and (len(model) > 256 or not model.isprintable()):
        raise click.BadParameter("a model id of at most 256 printable characters",
                                 param_hint="--model")


#: Seconds one call of an endpoint of the pool may take during a calibration (offline).
CALIBRATION_ENDPOINT_TIMEOUT_S = 60.0


def _pool_domain(settings, route: str, model: str, namespace_prefix: str):
    """The configured domain with exactly these matchers that names an endpoint of the
    pool (``embeddings_url`` / ``rerank_url``), or None."""
    for d in settings.cache.semantic_domains or ():
        if (d.route, d.model, d.namespace_prefix) == (route, model, namespace_prefix) \
                and d.remote:
            return d
    return None


def _pool_models(dom, settings, no_verifier: bool) -> tuple[object | None, object | None]:
    """(embeddings model or None, reranker or None) of a domain's endpoints of the pool,
    as the embedder uses them. Raises ``click.ClickException`` when the embeddings
    endpoint does not answer."""
    from controlplane.embedder import remote

    access = remote.EndpointAccess(dom.api_key_env, dom.api_key_file, dom.ca_file,
                                   settings.controlplane.node_ca_file)
    m = rr = None
    if dom.embeddings_url:
        m = remote.RemoteEmbeddings(dom.embeddings_url, dom.embeddings_model,
                                    CALIBRATION_ENDPOINT_TIMEOUT_S, access)
        try:
            m.probe()
        except remote.EndpointError as exc:
            raise click.ClickException(f"the domain's embeddings endpoint: {exc}") from None
    if dom.rerank_url and not no_verifier and dom.verifier is not False:
        rr = remote.Reranker(dom.rerank_url, dom.rerank_model, CALIBRATION_ENDPOINT_TIMEOUT_S,
                             access, dom.rerank_format, dom.rerank_logits)
    return m, rr


def _languages_of(path: str | None) -> list[str]:
    """``cache.semantic_languages`` of the config at ``path`` (defaults without one)."""
    from pathlib import Path

    from controlplane.config import ConfigError, load_settings

    try:
        return load_settings(path if path and Path(path).exists() else None) \
            .cache.semantic_languages
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None


def _load_calibration(path: str | None, pairs_path: str, embedding_model: str | None,
                      no_verifier: bool, domain: tuple[str, str, str] = ("", "", ""),
                      ) -> tuple[Pairs, object, object | None]:
    """(labelled pairs, embedding model, verifier or None) for a calibration: the model
    and verifier of the config at ``path`` unless ``embedding_model`` /
    ``no_verifier``; for a ``domain`` (route, model, namespace prefix) configured with
    endpoints of the pool, those endpoints (as the embedder serves that domain). Raises
    ``click.ClickException`` with the loader's message."""
    from pathlib import Path

    from controlplane.config import ConfigError, load_settings
    from controlplane.embedder import calibration as cal
    from controlplane.embedder import verifier as ver

    try:
        settings = load_settings(path if path and Path(path).exists() else None)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        pairs = cal.load_pairs(pairs_path)
    except cal.PairsError as exc:
        raise click.ClickException(str(exc)) from None
    if pairs.skipped:
        click.echo(f"note: {pairs.skipped} line(s) of {pairs_path} held no usable pair "
                   "(a header, a label other than 0 or 1, fewer than 3 fields, an empty text)")
    dom = None if embedding_model else _pool_domain(settings, *domain)
    m, v = _pool_models(dom, settings, no_verifier) if dom is not None else (None, None)
    if dom is not None:
        click.echo(f"note: the domain's endpoints of the pool: embeddings "
                   f"{dom.embeddings_url or '(the embedder model)'}, verifier "
                   f"{dom.rerank_url if v is not None else '(as configured)'}")
    if v is not None:
        return pairs, m if m is not None else _load_model(embedding_model, settings), v
    if m is None:
        m = _load_model(embedding_model, settings)
    v = None
    # the vectors of an endpoint: only a verifier trained on them (the domain's own)
    vfile = dom.verifier_file if dom is not None and dom.embeddings_url \
        else settings.cache.verifier_file
    if not no_verifier and settings.cache.verifier:
        try:
            v = ver.load_for(m.model_id, m.dim, vfile or None)
        except ver.VerifierError as exc:
            raise click.ClickException(str(exc)) from None
    return pairs, m, v


def _load_model(embedding_model: str | None, settings):
    """The embedder's own model (or ``--embedding-model``). Raises
    ``click.ClickException``."""
    from controlplane.embedder.models import ModelLoadError, ModelSpec, load_model

    try:
        return load_model(ModelSpec(model=embedding_model or settings.cache.embedder_model))
    except ModelLoadError as exc:
        raise click.ClickException(str(exc)) from None


def _print_calibration(res: CalibrationResult, model_id: str) -> None:
    """The notes, the pairs counted and the table of thresholds (every 0.05 and the one
    chosen)."""
    for note in res.notes:
        if note.startswith("WARNING"):
            click.secho(note, err=True, fg="red", bold=True)
        else:
            click.echo(f"note: {note}")
    click.echo(f"{res.pairs} pairs ({res.positives} matching, {res.negatives} not), "
               f"model {model_id}, score: {res.score}"
               + (f" (cosine >= {res.floor})" if res.floor is not None else ""))
    chosen_t = res.chosen.threshold if res.chosen else None
    shown = [r for r in res.rows if round(r.threshold * 100, 4) % 5 == 0
             or r.threshold == chosen_t]
    click.echo(f"fit part ({res.fit_pairs} pairs), where the threshold is chosen:")
    click.echo(table(("threshold", "hit rate", "wrong-hit rate", "wrong 95% bound", ""),
                     [(f"{r.threshold:.3f}", _rate(r.hit_rate), _rate(r.wrong_rate),
                       _rate(r.wrong_upper), "<- chosen" if r.threshold == chosen_t else "")
                      for r in shown]))
    rows = [("this calibration", res.check)]
    if res.trained is not None and res.baseline_check is not None:
        rows.append(("current verifier (its own threshold)", res.baseline_check))
    click.echo(f"check part ({res.check_pairs} pairs, questions not used to choose):")
    click.echo(table(("", "threshold", "hit rate", "wrong-hit rate", "wrong 95% bound"),
                     [(name, "-" if r is None else f"{r.threshold:.3f}",
                       _rate(r.hit_rate if r else None), _rate(r.wrong_rate if r else None),
                       _rate(r.wrong_upper if r else None)) for name, r in rows]))


def _endpoint_fields(path: str | None, route: str, model: str,
                     namespace_prefix: str) -> dict:
    """The endpoint settings of the configured domain with these matchers (kept when the
    calibration rewrites it), ``{}`` when it has none."""
    from pathlib import Path

    from controlplane.config import ConfigError, load_settings
    from controlplane.embedder.policy import REMOTE_FIELDS

    try:
        settings = load_settings(path if path and Path(path).exists() else None)
    except ConfigError:
        return {}
    dom = _pool_domain(settings, route, model, namespace_prefix)
    if dom is None:
        return {}
    defaults = type(dom).model_fields
    return {f: getattr(dom, f) for f in REMOTE_FIELDS
            if getattr(dom, f) != defaults[f].default}


def _write_calibration(path: str, res: CalibrationResult, entry: dict,
                       train_out: str | None) -> None:
    """Write the trained verifier (``train_out``) and the domain ``entry``, which names it
    as its own ``verifier_file``, into the config at ``path``. Raises
    ``click.ClickException``."""
    from pathlib import Path

    from controlplane.embedder import tuning

    if res.trained is not None and train_out:
        res.trained.save(train_out)
        entry["verifier_file"] = str(Path(train_out).resolve())
        entry["verifier"] = True
        click.echo(f"verifier written to {entry['verifier_file']} (this domain's only)")
    try:
        tuning.write_domain(path, entry)
    except tuning.TuningError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"written to {path} [[cache.semantic_domains]]"
               " (the embedder re-reads it within seconds when started with --config)")


@cache_cmd.command("calibrate")
@click.option("--pairs", "pairs_path", required=True, type=click.Path(dir_okay=False),
              help="Labelled pairs: TSV text1<TAB>text2<TAB>label, or JSONL with "
                   "text1/text2/label (or origin/similar: paraphrases only).")
@click.option("--route", default="", help="Domain: request path (/v1/chat/completions).")
@click.option("--model", default="", help="Domain: requested model.")
@click.option("--namespace-prefix", default="", help="Domain: leading hex digits of the "
              "semantic namespace.")
@click.option("--max-wrong", default=0.01, show_default=True, type=click.FloatRange(0, 1,
              min_open=True, max_open=True), help="Target wrong-hit rate (95 % upper bound).")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="TOML file the result is written into (default: the group's --config).")
@click.option("--embedding-model", default=None,
              help="Embedding model (default: cache.embedder_model of the config).")
@click.option("--no-verifier", is_flag=True, help="Calibrate the cosine with the guard; "
              "the domain then runs without the verifier.")
@click.option("--train-verifier", "train_out", type=click.Path(dir_okay=False), default=None,
              help="Fit a verifier on these pairs, write it to this JSON file and make it "
                   "this domain's verifier (the other domains keep theirs); refused when it "
                   "serves fewer pairs than the current one on the check part.")
@click.option("--allow-overlap", is_flag=True, help="Go on when more than 5 % of the texts "
              "are in the verifier's training data (the bounds then do not hold on new "
              "questions).")
@click.option("--folds", default=5, show_default=True, type=click.IntRange(2, 20))
@click.option("--bound", default="wilson", show_default=True,
              type=click.Choice(["wilson", "clopper-pearson"]))
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False),
              default="infergate-calibration.png", show_default=True,
              help="PNG of hit rate against wrong-hit bound (needs matplotlib).")
@click.option("--dry-run", is_flag=True, help="Print the table; write nothing.")
@click.pass_obj
def calibrate_cmd(c: Ctx, pairs_path: str, route: str, model: str, namespace_prefix: str,
                  max_wrong: float, config_path: str | None, embedding_model: str | None,
                  no_verifier: bool, train_out: str | None, allow_overlap: bool, folds: int,
                  bound: str, plot_path: str, dry_run: bool) -> None:
    """Choose a domain's semantic thresholds from labelled pairs and write them to the config.

    The pairs are split by text into a fit part, where the lowest threshold whose
    wrong-hit rate has a 95 % upper bound at or under --max-wrong is chosen, and a check
    part, where that bound must hold too; scored by the verifier (cosine >= its floor,
    then its probability), or by the cosine with the precision guard (--no-verifier)."""
    from pathlib import Path

    from controlplane.embedder import tuning
    from controlplane.embedder.models import EmbedError

    _check_domain(no_verifier, train_out, namespace_prefix, route, model)
    path = config_path or c.config
    if path and not Path(path).exists() and not dry_run:
        click.echo(f"note: {path} does not exist: it is created with this domain only "
                   "(every other setting at its default)")
    if plot_path and not dry_run and not Path(plot_path).resolve().parent.is_dir():
        raise click.BadParameter(f"the folder of {plot_path} does not exist",
                                 param_hint="--plot")
    pairs, m, v = _load_calibration(path, pairs_path, embedding_model, no_verifier,
                                    (route, model, namespace_prefix))
    try:
        res = tuning.calibrate(pairs, m, max_wrong, verifier=v, train=bool(train_out),
                               folds=folds, bound=bound, allow_overlap=allow_overlap)
    except tuning.TuningError as exc:
        raise click.ClickException(str(exc)) from None
    except EmbedError as exc:  # an endpoint of the pool failed on the way
        raise click.ClickException(f"an endpoint of the pool failed: {exc}") from None
    _print_calibration(res, m.model_id)
    if plot_path and not dry_run:
        if tuning.plot(res, plot_path, f"{m.model_id}: {route or '*'} {model or '*'} "
                                       f"{namespace_prefix or '*'}"):
            click.echo(f"plot: {plot_path}")
        else:
            click.echo("note: matplotlib not installed, no plot")
    why = tuning.check_verdict(res, max_wrong)
    if why is not None:
        raise click.ClickException(why)
    assert res.chosen is not None and res.check is not None
    warning = tuning.check_warning(res, max_wrong)
    if warning:
        click.secho(warning, err=True, fg="red", bold=True)
    entry = tuning.domain_entry(res, route, model, namespace_prefix, _languages_of(path))
    entry.update(_endpoint_fields(path, route, model, namespace_prefix))
    click.echo(f"chosen: {res.score} >= {res.chosen.threshold:.3f}; on the check part: hit "
               f"rate {_rate(res.check.hit_rate)}, wrong-hit rate {_rate(res.check.wrong_rate)}"
               f" (95% bound {_rate(res.check.wrong_upper)})")
    if "languages" in entry:
        click.echo(f"languages of the pairs: {', '.join(res.languages)}; their questions may "
                   f"hit in this domain (languages = {entry['languages']})")
    if dry_run:
        return
    if not path:
        click.echo("note: no --config given, nothing written")
        return
    _write_calibration(path, res, entry, train_out)
