import pytest

from pipeline.cli import main
from infra.config import ConfigError, OSDConfig, env_overrides, load_config

pytestmark = pytest.mark.pure


def test_defaults_are_the_models_own():
    # No file, no environment: the models' defaults, the one place each is written.
    assert load_config(environ={}) == OSDConfig()


def test_env_override_is_typed_and_nested():
    cfg = load_config(environ={"OSD_SERVE__NUM_REPLICAS": "3", "OSD_TRAIN__OFFLOAD_OPTIMIZER": "true",
                               "OSD_MODEL__TARGET": "tiny-random", "OSD_API_KEY": "secret"})
    assert cfg.serve.num_replicas == 3
    assert cfg.train.offload_optimizer is True
    assert cfg.model.target == "tiny-random"


def test_unknown_env_key_names_dotted_path():
    with pytest.raises(ConfigError, match=r"serve\.replicaz: unknown key"):
        load_config(environ={"OSD_SERVE__REPLICAZ": "2"})


def test_the_native_kernels_switches_are_not_config_keys():
    """OSD_NATIVE_AMX, OSD_NATIVE_LOGITS and OSD_NATIVE_HEAD, which the docs tell users to set, are read by the
    native runner; every osd command refused them as unknown keys before."""
    load_config(environ={"OSD_NATIVE_AMX": "off", "OSD_NATIVE_LOGITS": "off", "OSD_NATIVE_ISA": "avx2",
                         "OSD_NATIVE_HEAD": "off"})


def test_bad_value_names_path_and_reason():
    with pytest.raises(ConfigError) as e:
        load_config(environ={"OSD_SERVE__PORT": "70000", "OSD_TRAIN__ZERO_STAGE": "4",
                             "OSD_TRAIN__REPLAY_STEPS": "-1"})
    msg = str(e.value)
    assert "serve.port: Input should be less than or equal to 65535 (got '70000')" in msg
    assert "train.zero_stage" in msg
    assert "train.replay_steps: Input should be greater than or equal to 0 (got '-1')" in msg


def test_unknown_key_in_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("serve:\n  port: 8001\nstream:\n  redis: x\n")
    with pytest.raises(ConfigError, match=r"c\.yaml.*\n  stream\.redis: unknown key"):
        load_config(f, environ={})


def test_file_then_env_precedence(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("serve:\n  port: 8001\n  k: 6\n")
    cfg = load_config(f, environ={"OSD_SERVE__K": "2"})
    assert (cfg.serve.port, cfg.serve.k) == (8001, 2)
    assert cfg.serve.num_replicas == 1  # untouched fields keep their defaults


def test_cross_field_invariants():
    with pytest.raises(ConfigError, match="offload_optimizer needs zero_stage 2 or 3"):
        load_config(environ={"OSD_TRAIN__ZERO_STAGE": "1", "OSD_TRAIN__OFFLOAD_OPTIMIZER": "true"})
    with pytest.raises(ConfigError, match="canary_steps"):
        load_config(environ={"OSD_ROLLOUT__CANARY_STEPS": "[0.5, 0.1]"})


def test_bad_yaml_and_missing_file(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("serve: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(f, environ={})
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "nope.yaml", environ={})
    f.write_text("- a list\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(f, environ={})


def test_env_path_segments():
    # pydantic-settings reads the tree; the field converts the string (lists and mappings are YAML).
    assert env_overrides({"OSD_SERVE__SUFFIX__MAX_TOKENS": "8", "OTHER": "x", "OSD_API_KEY": "k"}) == \
        {"serve": {"suffix": {"max_tokens": "8"}}}
    with pytest.raises(ConfigError, match="empty path segment"):
        env_overrides({"OSD_SERVE____K": "1"})
    with pytest.raises(ConfigError, match=r"OSD_SERVEZ__K: servez\.k: unknown key"):
        env_overrides({"OSD_SERVEZ__K": "1"})


def test_env_values_keep_their_yaml_forms():
    import yaml

    keys = [{"key": "k" * 12, "tenant": "acme", "admin": True}]
    cfg = load_config(environ={"OSD_TRAIN__RESOURCES": "{trainer: 1}", "OSD_SERVE__API_KEYS": yaml.safe_dump(keys),
                               "OSD_TRAIN__WARM_BUDGET_MINUTES": "null", "OSD_ROLLOUT__CANARY_STEPS": "[0.5, 1.0]",
                               "OSD_SERVE__TENANTS__ACME__RECORD": "never", "OSD_NATIVE_ISA": "off",
                               "OSD_STREAM__USERS__PRODUCER__PASSWORD": "12345678"})
    assert cfg.train.resources == {"trainer": 1.0} and cfg.serve.api_keys[0].tenant == "acme"
    assert cfg.train.warm_budget_minutes is None and cfg.rollout.canary_steps == [0.5, 1.0]
    assert cfg.serve.tenants["acme"].record == "never"
    assert cfg.stream.users.producer.password == "12345678"  # a string field keeps digits as text
    with pytest.raises(ConfigError, match="resources: value is not valid YAML"):
        load_config(environ={"OSD_TRAIN__RESOURCES": "{a: [}"})


def test_cli_config_show(capsys, monkeypatch):
    monkeypatch.setenv("OSD_SERVE__K", "7")
    assert main(["config", "show"]) == 0
    assert "  k: 7\n" in capsys.readouterr().out


def test_cli_bad_config_exits_2_without_traceback(capsys, monkeypatch):
    monkeypatch.setenv("OSD_SERVE__NUM_REPLICAS", "0")
    assert main(["config", "show"]) == 2
    err = capsys.readouterr().err
    assert "serve.num_replicas" in err and "Traceback" not in err


def test_redis_url_scheme_checked_at_load():
    with pytest.raises(ConfigError, match=r"stream\.redis_url: .*must start with redis://, rediss:// or unix://"):
        load_config(environ={"OSD_STREAM__REDIS_URL": "http://127.0.0.1:6379"})
    for ok in ("", "redis://h:1/0", "rediss://u:p@h:2/1", "unix:///tmp/r.sock"):
        assert load_config(environ={"OSD_STREAM__REDIS_URL": ok}).stream.redis_url == ok


def test_stream_cap_follows_memory_budget():
    s = load_config(environ={"OSD_STREAM__MEMORY_BUDGET_MB": "56", "OSD_STREAM__LAG_BUDGET": "500"}).stream
    assert s.maxlen == 0 and s.max_entries == 1024  # 56 MB / 56 KB
    s = load_config(environ={"OSD_STREAM__MAXLEN": "300", "OSD_STREAM__LAG_BUDGET": "300"}).stream
    assert s.max_entries == 300  # set explicitly: used as is
    # The default cap is what the default budget holds, not 100,000 records (5.5 GB).
    d = OSDConfig().stream
    from infra.config import RECORD_KB

    assert d.max_entries * RECORD_KB <= d.memory_budget_mb * 1024 and d.lag_budget <= d.max_entries


def test_stream_budget_combinations_refused_with_field():
    with pytest.raises(ConfigError, match=r"stream\.maxlen: .*100000 records of ~56 KB take ~5469 MB, over "
                                          r"memory_budget_mb 1024"):
        load_config(environ={"OSD_STREAM__MAXLEN": "100000"})
    with pytest.raises(ConfigError, match=r"stream\.lag_budget: .*20000 exceeds the stream's cap of 18724"):
        load_config(environ={"OSD_STREAM__LAG_BUDGET": "20000"})
    with pytest.raises(ConfigError, match=r"stream\.lag_budget: .*exceeds the stream's cap of 100 records"):
        load_config(environ={"OSD_STREAM__MAXLEN": "100"})
    assert load_config(environ={"OSD_STREAM__MAXLEN": "100", "OSD_STREAM__LAG_BUDGET": "0"}).stream.max_entries == 100


@pytest.mark.parametrize("flag", [[], ["--json"]])
def test_cli_config_show_hides_passwords(capsys, monkeypatch, flag):
    monkeypatch.setenv("OSD_STREAM__REDIS_URL", "redis://:s3cret-pw@db.example:6379/0")
    assert main(["config", "show", *flag]) == 0
    out = capsys.readouterr().out
    assert "redis://:***@db.example:6379/0" in out and "s3cret-pw" not in out


@pytest.mark.parametrize("key", ["prefill_chunk", "max_concurrency"])
def test_batching_sizes_below_one_are_refused_by_name(key):
    with pytest.raises(ConfigError, match=rf"serve\.{key}: Input should be greater than or equal to 1"):
        load_config(environ={}, overrides={"serve": {key: 0}})


@pytest.mark.parametrize("bad", ["1,1,1", "4,0,2", "a,b,c", "4,2", "16;4;4"])
def test_a_bad_tree_is_refused_at_load(bad):
    with pytest.raises(ConfigError, match=r'serve\.tree: .*a tree is "TOTAL,DEPTH,TOPK"'):
        load_config(environ={"OSD_SERVE__TREE": bad})


def test_a_good_tree_loads():
    assert load_config(environ={"OSD_SERVE__TREE": "16,4,4"}).serve.tree == "16,4,4"
    assert load_config(environ={}).serve.tree == ""


def test_engine_options_take_the_serve_defaults_and_validators():
    # One definition of each serving default and bound: ServeConfig's.
    from serve.engine.core import EngineError, EngineOptions

    serve = OSDConfig().serve
    opts = EngineOptions()
    for name in ("k", "k_policy", "max_concurrency", "max_queue", "queue_timeout_s", "capture_top_k",
                 "max_seq_len", "prefill_chunk", "cuda_graphs", "tree"):
        assert getattr(opts, name) == getattr(serve, name), name
    assert EngineOptions.from_config(serve) == opts
    with pytest.raises(EngineError, match="tree"):
        EngineOptions(tree="4,2")


@pytest.mark.parametrize("section, key, value", [("serve", "draft_confidence", 0.3), ("train", "loss", "jsd"),
                                                 ("train", "jsd_beta", 0.3), ("train", "positions", "mix"),
                                                 ("train", "mix_weight", 0.4), ("train", "anchor_kl", 0.5),
                                                 ("train", "warm_replay_fraction", 0.5),
                                                 ("train", "warm_teacher_dir", "/tmp/t"),
                                                 ("data", "held_out_fraction", 0.1), ("serve", "max_body_bytes", 2048),
                                                 ("serve", "swap_retry_s", 1.0), ("stream", "write_batch", 8),
                                                 ("stream", "record_kb", 30), ("train", "grad_clip", 0.5),
                                                 ("train", "stale_keep", 0.2), ("train", "head_token_budget", 64),
                                                 ("rollout", "tau", 0.2)])
def test_a_retired_setting_loads_with_a_warning_naming_where_it_went(tmp_path, section, key, value):
    from infra.config import RetiredSettingWarning

    f = tmp_path / "old.yaml"
    f.write_text(f"{section}:\n  {key}: {value}\n  k: 3\n" if section == "serve" else f"{section}:\n  {key}: {value}\n")
    with pytest.warns(RetiredSettingWarning, match=rf"{section}\.{key} is no longer a setting and is ignored: "):
        cfg = load_config(f, environ={})
    assert key not in getattr(cfg, section).model_dump()
    assert cfg == load_config(environ={}, overrides={"serve": {"k": 3}} if section == "serve" else {})


def test_retired_suffix_keys_and_env_too():
    from infra.config import RetiredSettingWarning

    with pytest.warns(RetiredSettingWarning, match=r"serve\.suffix\.factor .*SuffixDraft"):
        cfg = load_config(environ={"OSD_SERVE__SUFFIX__FACTOR": "2", "OSD_SERVE__SUFFIX__MAX_TOKENS": "8"})
    assert cfg.serve.suffix.max_tokens == 8
    with pytest.warns(RetiredSettingWarning, match=r"serve\.suffix\.offset"):
        load_config(environ={}, overrides={"serve": {"suffix": {"offset": 1.0}}})


def test_the_gate_is_a_section_and_its_old_flat_keys_still_load():
    from infra.config import RetiredSettingWarning

    f_new = load_config(environ={}, overrides={"train": {"gate": {"records": 50, "min_records": 5}}})
    assert (f_new.train.gate.records, f_new.train.gate.min_records, f_new.train.gate.resamples) == (50, 5, 2000)
    with pytest.warns(RetiredSettingWarning) as got:
        old = load_config(environ={"OSD_TRAIN__GATE_RECORDS": "50", "OSD_TRAIN__GATE_MIN_RECORDS": "5"})
    assert old == f_new
    assert sorted(str(w.message).split(";")[0] for w in got) == [
        "train.gate_min_records is now train.gate.min_records", "train.gate_records is now train.gate.records"]
    assert load_config(environ={"OSD_TRAIN__GATE__RESAMPLES": "300"}).train.gate.resamples == 300
    with pytest.raises(ConfigError, match=r"train\.gate\.confidence"), pytest.warns(RetiredSettingWarning):
        load_config(environ={}, overrides={"train": {"gate_confidence": 1.5}})


def test_the_ingress_runs_in_a_lone_replica_unless_told_otherwise():
    assert load_config(environ={}).serve.ingress_in_replica
    assert not load_config(environ={"OSD_SERVE__NUM_REPLICAS": "2"}).serve.ingress_in_replica
    assert not load_config(environ={"OSD_SERVE__INGRESS": "separate"}).serve.ingress_in_replica
    with pytest.raises(ConfigError, match=r'ingress "replica" .* needs num_replicas 1 \(got 2\)'):
        load_config(environ={"OSD_SERVE__INGRESS": "replica", "OSD_SERVE__NUM_REPLICAS": "2"})


def test_direct_http_needs_the_routes_in_a_lone_replica_and_sets_serves_env():
    from pipeline.stack.launch import direct_http_env

    with pytest.raises(ConfigError, match=r'http "direct" needs the routes in the replica'):
        load_config(environ={"OSD_SERVE__HTTP": "direct", "OSD_SERVE__INGRESS": "separate"})
    cfg = load_config(environ={"OSD_SERVE__HTTP": "direct", "OSD_SERVE__PORT": "8123"})
    env = direct_http_env(cfg, joining=False)
    assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    # One port, the configured one: Serve's port range is [min, max).
    assert (env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"], env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"]) == ("8123", "8124")
    assert direct_http_env(cfg, joining=True) == {}  # a running cluster's processes keep their environment
    # auto (the default): direct where the routes run in the lone replica, else Serve's proxy.
    assert direct_http_env(load_config(environ={}), joining=False)["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    for env in ({"OSD_SERVE__NUM_REPLICAS": "2"}, {"OSD_SERVE__INGRESS": "separate"}, {"OSD_SERVE__HTTP": "proxy"}):
        assert direct_http_env(load_config(environ=env), joining=False) == {}
