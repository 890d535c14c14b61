"""The command line: click commands that parse, call one function, and print text or one JSON object."""
