import pytest


@pytest.fixture(scope="session")
def tiny():
    """One tiny random target for the whole session (built in-process, ~0.2 s)."""
    from pipeline.target import load_target

    return load_target("tiny-random", progress=False)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """One private redis-server (AOF on, free loopback port) for the `redis` tests of a session."""
    from pipeline.redis_server import RedisServer

    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server):
    """The session server's URL, emptied before each test."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url
