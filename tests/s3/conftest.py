"""S3 tests use the session-wide SeaweedFS fixtures of tests/conftest.py."""
