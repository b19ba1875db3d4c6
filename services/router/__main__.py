from baton.services.router.server import main

main()
