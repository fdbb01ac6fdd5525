"""The selected tests, for tests/multiproc/joint_launch.py: a shared launch runs the cases of the modules whose
tests will read them."""

from tests.multiproc import joint_launch


def pytest_collection_finish(session):
    joint_launch.SELECTED.update((item.module.__name__, item.originalname) for item in session.items
                                 if getattr(item, "module", None) is not None)
