from loong_train.main import main

if __name__ == "__main__":  # spawned helper processes (e.g. checkpoint writers) re-import this module
    main()
