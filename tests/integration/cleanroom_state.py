"""State of a user's module, shipped by value with the tasks of test_clean_workers."""

VALUE = 0
