import configparser
import sys

cfg = configparser.ConfigParser()
if not cfg.read("/app/config/service.ini"):
    sys.exit("service.ini missing or unreadable")
want = {
    ("server", "host"): "0.0.0.0",
    ("server", "port"): "8080",
    ("server", "debug"): "false",
    ("server", "workers"): "4",
    ("database", "url"): "postgresql://db.internal:5432/app",
    ("database", "pool_size"): "10",
    ("database", "timeout_seconds"): "30",
    ("logging", "level"): "info",
    ("logging", "format"): "json",
    ("cache", "backend"): "redis",
    ("cache", "ttl_seconds"): "300",
}
bad = [f"[{s}] {k} = {cfg.get(s, k, fallback=None)!r}, want {v!r}"
       for (s, k), v in want.items() if cfg.get(s, k, fallback=None) != v]
extra = [f"[{s}] {k}" for s in cfg.sections() for k in cfg[s] if (s, k) not in want]
if bad or extra or sorted(cfg.sections()) != ["cache", "database", "logging", "server"]:
    sys.exit("; ".join(bad + [f"unexpected {e}" for e in extra]) or "wrong sections")
