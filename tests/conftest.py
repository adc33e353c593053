"""Suite-wide settings: everything offline, small torch thread pools."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# As the carpool command does, before any test module imports torch: OpenMP threads sleep
# at barriers instead of spinning (the suite shares two cores with the servers it starts).
from carpool.engine.process import configure_process

configure_process()

# CI runs the property tests on a fixed seed, so a run passes or fails the same way every
# time; a run elsewhere draws new examples, which is how rare disagreements get found.
if os.environ.get("CI"):
    from hypothesis import settings

    settings.register_profile("ci", derandomize=True)
    settings.load_profile("ci")
