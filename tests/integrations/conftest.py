# The checkers run inside the frameworks' venvs (through test_verl.py / test_openrlhf.py), never here.
collect_ignore = ["check_verl.py", "check_openrlhf.py"]
