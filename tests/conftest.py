"""Suite-wide settings."""
from hypothesis import settings

# No timing assertions in tests: Hypothesis's 200 ms deadline fails property tests on a loaded CI machine.
settings.register_profile("suite", deadline=None)
settings.load_profile("suite")
