"""Small runtime helpers any process uses: the clock, supervised tasks, private files."""
