"""The command line: argument parsing, exit codes and output. The library never imports it."""
