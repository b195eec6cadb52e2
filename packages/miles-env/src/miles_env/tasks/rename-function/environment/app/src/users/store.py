USERS = {1: {"name": "ada"}, 2: {"name": "grace"}}
