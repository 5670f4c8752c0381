"""Where the tests find the checkout's files, whatever folder the test module sits in."""
import os

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)                          # the checkout: configs/, scripts/, ms_llm/
CONFIGS = os.path.join(ROOT, "configs")
FIXTURES = os.path.join(TESTS, "fixtures")             # data files checked in beside the tests
WORKERS = os.path.join(TESTS, "dist_workers")          # the scripts the msrun tests launch
